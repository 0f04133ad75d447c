"""Registry weights for a cluster without internet: what each model needs, fetched where
the hub is reachable, verified offline before any job trusts them.

`fetch` writes `<dir>/<model>/<file>` and `<dir>/manifest.json` (model, hub repository,
revision, file name, size, sha256). `verify` checks each file as a job would load it
(weights only, nothing executed) and its width against the registry, one line per problem,
so that a copy truncated on its way to the cluster fails there, not in the first job.
"""

from __future__ import annotations

import errno
import json
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from slidesnake.atomic import atomic_output
from slidesnake.errors import ConfigError, ModelError, WeightsError
from slidesnake.models.checkpoints import HUB_FILES, load_state_dict
from slidesnake.models.embedder import UnfitWeights, check_fit, parameter_count
from slidesnake.models.registry import REGISTRY, ModelSpec
from slidesnake.side_files import MB, sha256, side_file_problem

MANIFEST = "manifest.json"
GB = 1e9
DEFAULT_ENDPOINT = "https://huggingface.co"
# Whether the hub asks for the model's licence to be accepted before a download, as
# each model's page said when it was added; the hub's answer at fetch time decides.
GATED = {"h-optimus-0": True, "h-optimus-1": True, "h0-mini": True, "uni": True,
         "uni2-h": True, "virchow2": True, "phikon-v2": False}  # fmt: skip


@dataclass(frozen=True)
class HubWeights:
    """One registry model's weights on the hub."""

    model: str
    repo: str
    files: tuple[str, ...]  # the first of these the repository has is fetched
    gated: bool | None
    parameters: int  # from the architecture: the file is about 4 bytes each at fp32


def hub_weights(name: str) -> HubWeights:
    spec = _hub_spec(name)
    return HubWeights(name, _repo(spec), HUB_FILES, GATED.get(name), parameter_count(spec))


def hub_models() -> list[str]:
    """The registry models whose weights are on the hub."""
    return [name for name, spec in REGISTRY.items() if spec.hub_id]


def _hub_spec(name: str) -> ModelSpec:
    spec = REGISTRY.get(name)
    if spec is None or spec.hub_id is None:
        known = ", ".join(hub_models())
        raise ConfigError(f"'{name}' is no registry model with hub weights; choose: {known}")
    return spec


def _repo(spec: ModelSpec) -> str:
    return spec.hub_id.removeprefix("hf-hub:")


def endpoint() -> str:
    """The hub, or a mirror of it: huggingface_hub's own variable, read at each call."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def max_file_bytes(parameters: int) -> int:
    """The most a model's weight file may hold: its parameters at fp32, with a margin for
    the file's own records (names, shapes, a pickle's structure)."""
    return int(parameters * 4 * 1.1) + MB


def fetch(names: list[str], directory: Path) -> dict:
    """Download each model's weights into `directory`/<model>/ and record them in the
    manifest there (models fetched before stay in it). A download is bounded by what the
    model can need (`max_file_bytes`), whatever the hub declares or sends."""
    specs = [_hub_spec(name) for name in names]
    manifest = read_manifest(directory) if (directory / MANIFEST).is_file() else {"models": {}}
    for name, spec in zip(names, specs, strict=True):
        bound = _Bound(name, parameter_count(spec))
        path, revision = _download(_repo(spec), directory / name, bound)
        size = path.stat().st_size
        manifest["models"][name] = {
            "repo": _repo(spec),
            "revision": revision,
            "files": [{"name": path.name, "size": size, "sha256": sha256(path)}],
        }
    with atomic_output(directory / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


@dataclass(frozen=True)
class _Bound:
    """The size bound of one model's download, and the line that refuses more."""

    model: str
    parameters: int

    @property
    def bytes(self) -> int:
        return max_file_bytes(self.parameters)

    def refusal(self, where: str, what: str) -> WeightsError:
        return WeightsError(
            f"{where} {what}, more than model '{self.model}' can need ({self.parameters:,} "
            f"parameters: {self.bytes / GB:.2f} GB at most at fp32); refused and nothing "
            "kept: the hub (or HF_ENDPOINT's mirror) does not serve this model's weights"
        )


def _download(repo: str, destination: Path, bound: _Bound) -> tuple[Path, str]:
    """The first of HUB_FILES that `repo` has, at its current revision."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError

    hub = endpoint()
    for filename in HUB_FILES:
        where = f"{hub}/{repo}: {filename}"
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo, filename, endpoint=hub), endpoint=hub)
            if meta.size is not None and meta.size > bound.bytes:
                raise bound.refusal(where, f"is declared {meta.size / GB:.2f} GB")
            with _file_size_limit(bound.bytes):
                path = hf_hub_download(repo, filename, revision=meta.commit_hash,
                                       local_dir=destination, endpoint=hub)  # fmt: skip
            return Path(path), meta.commit_hash
        except EntryNotFoundError:
            continue
        except GatedRepoError:
            raise WeightsError(
                f"{hub}/{repo} is gated: accept its licence on the model's page with your "
                "account, then set HF_TOKEN (or run `hf auth login`) and fetch again"
            ) from None
        except OSError as err:
            if err.errno != errno.EFBIG:
                raise WeightsError(f"{where} could not be written ({err})") from None
            for partial in (destination / ".cache").rglob("*.incomplete"):  # not to resume
                partial.unlink()
            raise bound.refusal(where, f"was sent past {bound.bytes / GB:.2f} GB") from None
        except WeightsError:
            raise
        except Exception as err:  # the hub's client raises its HTTP library's errors too
            raise WeightsError(
                f"{where} could not be fetched ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); fetch on a machine that "
                "reaches the hub (or set HF_ENDPOINT to a mirror)"
            ) from None
    raise WeightsError(f"{hub}/{repo} has none of {', '.join(HUB_FILES)}")


@contextmanager
def _file_size_limit(max_bytes: int) -> Iterator[None]:
    """No file this process writes grows past `max_bytes` (a write past it fails with
    EFBIG: Python ignores SIGXFSZ): the hub's client writes what the server sends, and a
    server may send without end. Only while the hub's client runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    problem = side_file_problem(path, max_bytes=1 << 20)
    if problem is not None:
        raise WeightsError(f"{path} {problem}; run `slidesnake weights fetch` into {directory}")
    try:
        manifest = json.loads(path.read_text())
        for model, entry in manifest["models"].items():
            if not _plain_name(model):
                raise ValueError(f"a model name {model!r} is not a folder's plain name")
            for record in entry["files"]:
                name, size, digest = record["name"], record["size"], record["sha256"]
                if not _plain_name(name) or not isinstance(size, int) or len(digest) != 64:
                    raise ValueError(f"a file record {record!r} is malformed")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise WeightsError(f"{path} is no weights manifest ({err}); fetch again") from None
    return manifest


def _plain_name(name: object) -> bool:
    """A name that stays in the folder it is joined to: no separator, not . or .."""
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")


def verify(directory: Path) -> list[tuple[str, str | None]]:
    """(file, problem or None) for every file of the manifest; nothing here runs code from
    a file or needs the network."""
    results = []
    for name, entry in read_manifest(directory)["models"].items():
        for record in entry["files"]:
            path = directory / name / record["name"]
            results.append((str(path), _problem(directory, name, record)))
    return results


def _problem(directory: Path, name: str, record: dict) -> str | None:
    path = directory / name / record["name"]
    outside = _outside(path, directory)
    if outside:
        return outside
    problem = side_file_problem(path)
    if problem is not None:
        return f"{problem}; copy it again from where it was fetched"
    size = path.stat().st_size
    if size != record["size"]:
        return (f"is {size} bytes, the manifest says {record['size']}: truncated or "
                "changed on its way; copy it again")  # fmt: skip
    if sha256(path) != record["sha256"]:
        return "has another sha256 than the manifest's: the file changed; copy it again"
    spec = REGISTRY.get(name)
    if spec is None:
        return f"'{name}' is no registry model of this slidesnake version"
    return weights_problem(spec, path)


def _outside(path: Path, directory: Path) -> str | None:
    """Why `path` is not inside `directory` once links are followed, or None."""
    try:
        inside = path.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError) as err:  # a link loop
        return f"cannot be resolved ({err}); copy it again as a file"
    if inside:
        return None
    return (f"is a link to {path.resolve()}, outside {directory}: a manifest's files are "
            "checked in its folder only; copy the file itself there")  # fmt: skip


def weights_problem(spec: ModelSpec, path: Path, input_size: int | None = None) -> str | None:
    """Why the state dict at `path` would fail a job of model `spec`, or None: it loads
    as weights only, has the registry's width and fills the architecture exactly."""
    try:
        state = load_state_dict(path)
    except ModelError as err:
        return str(err)
    width = _width(state, spec)
    if width is not None and spec.dim is not None and width != spec.dim:
        return (f"holds a model {width} wide, but '{spec.name}' is {spec.dim} wide: it is "
                "another model's weights; fetch the right repository")  # fmt: skip
    try:
        check_fit(spec, state, path, input_size)
    except UnfitWeights as err:
        return str(err)
    return None


def _width(state: dict[str, torch.Tensor], spec: ModelSpec) -> int | None:
    """The embedding width a ViT's state dict gives: its final norm's, twice that where
    the model concatenates the class token and the patch tokens' mean."""
    norm = state.get("norm.weight")
    if norm is None or norm.dim() != 1:
        return None
    return norm.shape[0] * (2 if spec.output == "cls+mean" else 1)
