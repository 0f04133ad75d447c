"""Model weights from disk or a hub, in every format our users have.

safetensors and PyTorch state dicts fill a timm architecture; `torch.export` programs
(.pt2) and TorchScript archives are whole programs that need none. Nothing here executes
code from the file: state dicts load with `weights_only=True`, a .pt2 archive is checked
as plain data before torch reads it (`pt2_archive`), and TorchScript archives are read by
torch's C++ loader, whose unpickler builds tensors and TorchScript objects only.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import zipfile
from contextlib import nullcontext
from pathlib import Path

import torch

from slidesnake.errors import ModelError
from slidesnake.models.pt2_archive import archive_weights, check_archive, without_guards
from slidesnake.side_files import cached_sha256, side_file_problem

log = logging.getLogger(__name__)

STATE_DICT_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin"}


class WeightsDigest(threading.Thread):
    """The sha256 of a weights file, for the store's attributes, without a full read of
    the file per slide on the critical path: digests are cached per file
    (`side_files.cached_sha256`), and a file not yet cached is hashed in this thread
    while tiles stream. `value()` waits for it."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(name="weights-sha256", daemon=True)
        self.path = Path(path)
        self.digest: str | None = None
        self.start()

    def run(self) -> None:
        self.digest = cached_sha256(self.path)

    def value(self) -> str:
        self.join()
        if self.digest is None:
            raise ModelError(f"checkpoint {self.path} could not be read to hash it")
        return self.digest


def is_program(path: str | Path) -> bool:
    """True for a whole-program checkpoint (.pt2 export or TorchScript)."""
    path = Path(path)
    check_file(path)
    return path.suffix == ".pt2" or _is_torchscript(path)


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def check_file(path: Path) -> None:
    """A regular file, before anything opens it: a FIFO would block the job for ever."""
    problem = side_file_problem(path)
    if problem is not None:
        raise ModelError(f"checkpoint {path} {problem}; give a weights file")


def load_program(path: str | Path, device: torch.device) -> torch.nn.Module:
    """A whole-program checkpoint as a module, in the dtype it was saved in."""
    path = Path(path)
    check_file(path)
    guarded = check_archive(path) if path.suffix == ".pt2" else False
    try:
        if path.suffix == ".pt2":
            with without_guards(path) if guarded else nullcontext(path) as readable:
                return torch.export.load(str(readable)).module().to(device)
        return torch.jit.load(str(path), map_location=device).eval()
    except Exception as err:
        raise ModelError(
            f"checkpoint {path} is not a readable {path.suffix} program ({err}); "
            "export it again with torch.export.save or torch.jit.save"
        ) from None


def load_state_dict(
    path: str | Path, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or PyTorch state-dict file, unwrapped from common wrappers,
    read straight onto `device` in the dtype they were saved in."""
    path = Path(path)
    check_file(path)
    if path.suffix == ".pt2":
        return _archive_state_dict(path, device)
    if path.suffix not in STATE_DICT_SUFFIXES:
        raise ModelError(
            f"checkpoint {path}: unknown format '{path.suffix}'; use .safetensors, "
            ".pt/.pth/.bin (a state dict), .pt2 (torch.export) or a TorchScript archive"
        )
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device=str(device))
        else:
            state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ModelError(
            f"checkpoint {path} is refused: it is a pickle of more than tensors, which could "
            f"run code when loaded ({str(err).splitlines()[0]}); save the state dict alone "
            "(torch.save(model.state_dict(), path)) or convert it to safetensors"
        ) from None
    except Exception as err:
        raise ModelError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
            "the file is corrupt or truncated; download or save it again"
        ) from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"checkpoint {path} is not a state dict of tensors")
    return state


def _archive_state_dict(path: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The weights of a .pt2 program, for an architecture of ours: checked like any
    archive, read without building the program."""
    check_archive(path)
    try:
        state = archive_weights(path)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise ModelError(
            f"checkpoint {path}: its weights cannot be read ({type(err).__name__}: {err}); "
            "export it again with torch.export.save"
        ) from None
    return {name: tensor.to(device) for name, tensor in state.items()}


def fetch_from_hub(hub_id: str) -> Path:
    """A hub checkpoint from the local cache, else from the network; fails at once offline.

    The hub client retries an unreachable host for about a minute per file; a job on a
    compute node without internet must instead say at once what to do.
    """
    from huggingface_hub import hf_hub_download

    repo = hub_id.removeprefix("hf-hub:")
    online = not _offline() and _reachable(HUB_HOST)
    for filename in HUB_FILES:
        try:
            return Path(hf_hub_download(repo, filename, local_files_only=not online))
        except Exception as err:  # missing, gated, or not cached: try the next name
            last = err
    where = "the hub refused them" if online else f"{HUB_HOST} cannot be reached from here"
    raise ModelError(
        f"model weights '{hub_id}' are not in the local Hugging Face cache and {where} "
        f"({type(last).__name__}); download the weights of {repo} ({HUB_FILES[0]}) on a machine "
        "with internet access and set model.checkpoint to the local file"
    )


HUB_HOST = "huggingface.co"
HUB_FILES = ("model.safetensors", "pytorch_model.bin")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def _reachable(host: str, timeout_s: float = 3.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True
