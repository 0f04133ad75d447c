"""`slidesnake weights`: list what each registry model needs, fetch it from a hub, verify
the copy offline. The hub is a stand-in on loopback that answers huggingface_hub's file
requests (HEAD and GET of /<repo>/resolve/<revision>/<file>, with the headers the hub
sends) and is reached through HF_ENDPOINT, as a mirror would be; huggingface_hub itself
runs unchanged. The registry gains tiny models of timm's `test_vit` for the test."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import resource
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch
from safetensors.torch import save

from slidesnake.cli import main
from slidesnake.models import registry, weight_files
from slidesnake.models.embedder import build_network
from slidesnake.models.registry import IMAGENET_MEAN, IMAGENET_STD, ModelSpec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_standin_token_5c1e"


class Hub(BaseHTTPRequestHandler):
    """The hub's file endpoints: `files` maps (repo, file name) to bytes; a repository
    in `gated` answers only a request with the token."""

    files: ClassVar[dict[tuple[str, str], bytes]] = {}
    gated: ClassVar[set[str]] = set()
    declared: ClassVar[int | None] = None  # the size it says, if not the file's
    endless: ClassVar[bool] = False  # a body without end, its length unsaid

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/([^?]+)(\?.*)?", self.path)
        repo, _, name = match.groups()[:3] if match else ("", "", "")
        data = self.files.get((repo, name))
        if repo in self.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(401, "GatedRepo", f"Access to model {repo} is restricted.")
        elif data is None:
            self._error(404, "EntryNotFound", f"{name} does not exist in {repo}")
        else:
            digest = hashlib.sha256(data).hexdigest()
            size = str(self.declared or len(data))
            self.send_response(200)
            for key, value in (("X-Repo-Commit", COMMIT), ("X-Linked-Etag", f'"{digest}"'),
                               ("ETag", f'"{digest}"'), ("X-Linked-Size", size)):  # fmt: skip
                self.send_header(key, value)
            if not (body and self.endless):
                self.send_header("Content-Length", size)
            self.end_headers()
            if body and self.endless:
                self._send_without_end()
            elif body:
                self.wfile.write(data)

    def _send_without_end(self) -> None:
        self.close_connection = True
        block = bytes(1 << 20)
        try:
            while True:
                self.wfile.write(block)
        except OSError:
            pass  # the client stopped reading

    def _error(self, status: int, code: str, message: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def hub(monkeypatch, tmp_path) -> Iterator[type[Hub]]:
    served = type("Served", (Hub,), {"files": {}, "gated": set(), "declared": None,
                                     "endless": False})  # fmt: skip
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), served)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield served
    httpd.shutdown()


def tiny_spec(name: str) -> ModelSpec:
    return ModelSpec(name, "test_vit", None, None, IMAGENET_MEAN, IMAGENET_STD, "cls", 64,
                     f"hf-hub:standin/{name}")  # fmt: skip


@pytest.fixture
def tiny_models(monkeypatch) -> list[str]:
    names = ["tiny-a", "tiny-b"]
    for name in names:
        monkeypatch.setitem(registry.REGISTRY, name, tiny_spec(name))
    return names


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of the tiny models, as the architecture names them."""
    torch.manual_seed(seed)
    network = build_network(tiny_spec("x"), 224).network
    return {k: v.contiguous() for k, v in network.state_dict().items()}


def other_width_state(embed_dim: int) -> dict[str, torch.Tensor]:
    import timm

    network = timm.create_model("test_vit", num_classes=0, img_size=224, embed_dim=embed_dim)
    return {k: v.contiguous() for k, v in network.state_dict().items()}


def torch_bytes(state: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def weights(*args: str) -> None:
    main(["weights", *args])


def test_fetch_then_verify_gives_a_manifest_and_files_a_job_loads(
    hub, tiny_models, tmp_path, capsys
):
    safetensors = save(tiny_state(seed=1))
    state_dict = torch_bytes(tiny_state(seed=2))
    hub.files = {("standin/tiny-a", "model.safetensors"): safetensors,
                 ("standin/tiny-b", "pytorch_model.bin"): state_dict}  # fmt: skip
    carried = tmp_path / "carried"
    weights("fetch", *tiny_models, "--to", str(carried))
    out = capsys.readouterr().out
    assert f"tiny-a: model.checkpoint: {carried / 'tiny-a' / 'model.safetensors'}" in out
    manifest = json.loads((carried / "manifest.json").read_text())
    a, b = manifest["models"]["tiny-a"], manifest["models"]["tiny-b"]
    assert a["repo"] == "standin/tiny-a" and a["revision"] == COMMIT
    assert a["files"] == [{"name": "model.safetensors", "size": len(safetensors),
                           "sha256": hashlib.sha256(safetensors).hexdigest()}]  # fmt: skip
    assert b["files"][0]["name"] == "pytorch_model.bin"
    assert (carried / "tiny-b" / "pytorch_model.bin").read_bytes() == state_dict

    weights("verify", str(carried))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"OK    {carried / 'tiny-a' / 'model.safetensors'}",
                     f"OK    {carried / 'tiny-b' / 'pytorch_model.bin'}"]  # fmt: skip


def test_verify_catches_truncated_changed_pickled_and_other_width_files(
    hub, monkeypatch, tmp_path, capsys
):
    names = ["trunc", "changed", "pickled", "narrow", "good"]
    for name in names:
        monkeypatch.setitem(registry.REGISTRY, name, tiny_spec(name))
    good = save(tiny_state())
    pickled = torch_bytes({**tiny_state(), "config": argparse.Namespace(depth=6)})
    hub.files = {("standin/trunc", "model.safetensors"): good,
                 ("standin/changed", "model.safetensors"): good,
                 ("standin/pickled", "pytorch_model.bin"): pickled,
                 ("standin/narrow", "model.safetensors"): save(other_width_state(32)),
                 ("standin/good", "model.safetensors"): good}  # fmt: skip
    carried = tmp_path / "carried"
    weights("fetch", *names, "--to", str(carried))
    capsys.readouterr()
    truncated = carried / "trunc" / "model.safetensors"
    truncated.write_bytes(good[: len(good) // 2])  # a copy cut short on its way
    changed = bytearray(good)
    changed[-1] ^= 0xFF
    (carried / "changed" / "model.safetensors").write_bytes(bytes(changed))

    with pytest.raises(SystemExit) as exit_:
        weights("verify", str(carried))
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    lines = dict(line.split(": ", 1) for line in captured.out.splitlines() if ": " in line)
    assert lines[f"FAIL  {truncated}"].startswith(f"is {len(good) // 2} bytes, the manifest says")
    assert (
        "another sha256 than the manifest's" in lines[f"FAIL  {carried}/changed/model.safetensors"]
    )
    pickle_line = lines[f"FAIL  {carried}/pickled/pytorch_model.bin"]
    assert "refused: it is a pickle of more than tensors" in pickle_line
    width_line = lines[f"FAIL  {carried}/narrow/model.safetensors"]
    assert "holds a model 32 wide, but 'narrow' is 64 wide" in width_line
    assert f"OK    {carried}/good/model.safetensors" in captured.out
    assert "4 of 5 weight files failed verification" in captured.err


def test_a_gated_repository_needs_the_token_and_says_so(
    hub, tiny_models, tmp_path, monkeypatch, capsys
):
    hub.files = {("standin/tiny-a", "model.safetensors"): save(tiny_state())}
    hub.gated = {"standin/tiny-a"}
    with pytest.raises(SystemExit):
        weights("fetch", "tiny-a", "--to", str(tmp_path / "w"))
    error = capsys.readouterr().err
    assert "standin/tiny-a is gated: accept its licence" in error and "set HF_TOKEN" in error
    assert not (tmp_path / "w" / "manifest.json").exists()

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    weights("fetch", "tiny-a", "--to", str(tmp_path / "w"))
    assert (tmp_path / "w" / "tiny-a" / "model.safetensors").is_file()
    assert TOKEN not in (tmp_path / "w" / "manifest.json").read_text()


def test_fetch_names_what_it_cannot_find(hub, tiny_models, tmp_path, capsys):
    with pytest.raises(SystemExit):
        weights("fetch", "tiny-a", "--to", str(tmp_path / "w"))
    assert (
        "standin/tiny-a has none of model.safetensors, pytorch_model.bin" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        weights("fetch", "no-such-model", "--to", str(tmp_path / "w"))
    assert "'no-such-model' is no registry model with hub weights" in capsys.readouterr().err


def test_a_hub_that_cannot_be_reached_fails_in_one_line(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(SystemExit):
        weights("fetch", "tiny-a", "--to", str(tmp_path / "w"))
    error = capsys.readouterr().err
    assert "standin/tiny-a: model.safetensors could not be fetched (ConnectError" in error
    assert "fetch on a machine that reaches the hub" in error and "Traceback" not in error


@pytest.mark.parametrize("lie", ["declared", "endless"])
def test_a_hub_that_declares_or_sends_more_than_the_model_needs_is_cut_off(
    lie, hub, tiny_models, tmp_path, capsys
):
    """40 GB declared for a model of a few MB, or a body without end: refused at the
    model's bound (its parameters at fp32, with a margin), in seconds, nothing kept."""
    hub.files = {("standin/tiny-a", "model.safetensors"): save(tiny_state())}
    bound = weight_files.max_file_bytes(weight_files.hub_weights("tiny-a").parameters)
    if lie == "declared":
        hub.declared = 40 * 2**30
    else:
        hub.endless = True
    carried = tmp_path / "carried"
    started = time.monotonic()
    with pytest.raises(SystemExit):
        weights("fetch", "tiny-a", "--to", str(carried))
    assert time.monotonic() - started < 30
    error = capsys.readouterr().err
    said = "is declared 42.95 GB" if lie == "declared" else f"was sent past {bound / 1e9:.2f} GB"
    assert f"standin/tiny-a: model.safetensors {said}, more than model 'tiny-a' can need" in error
    assert "refused and nothing kept" in error
    written = [p for p in carried.rglob("*") if p.is_file()]
    assert [p for p in written if p.suffix in (".safetensors", ".incomplete")] == []
    assert not (carried / "manifest.json").exists()
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY

    hub.declared, hub.endless = None, False  # the hub mended: the fetch starts afresh
    weights("fetch", "tiny-a", "--to", str(carried))
    assert (carried / "tiny-a" / "model.safetensors").read_bytes() == save(tiny_state())


def test_verify_reads_nothing_outside_its_folder(hub, tiny_models, tmp_path, capsys):
    """A manifest's model name that is a path, or a file that links outside: refused."""
    hub.files = {("standin/tiny-a", "model.safetensors"): save(tiny_state()),
                 ("standin/tiny-b", "model.safetensors"): save(tiny_state())}  # fmt: skip
    carried = tmp_path / "carried"
    weights("fetch", *tiny_models, "--to", str(carried))
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere.safetensors"
    (carried / "tiny-b" / "model.safetensors").rename(elsewhere)
    (carried / "tiny-b" / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(SystemExit):
        weights("verify", str(carried))
    out = capsys.readouterr().out
    assert f"FAIL  {carried}/tiny-b/model.safetensors: is a link to {elsewhere}, outside" in out

    manifest = json.loads((carried / "manifest.json").read_text())
    entry = manifest["models"]["tiny-a"]
    for name in (str(tmp_path / "tiny-a"), "../tiny-a", ".."):
        manifest["models"] = {name: entry}
        (carried / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(SystemExit):
            weights("verify", str(carried))
        assert "is not a folder's plain name" in capsys.readouterr().err


def test_verify_without_a_manifest_says_to_fetch(tmp_path, capsys):
    with pytest.raises(SystemExit):
        weights("verify", str(tmp_path))
    assert "run `slidesnake weights fetch`" in capsys.readouterr().err


def test_list_shows_each_registry_model_its_repository_and_size(capsys):
    weights("list")
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("h-optimus-0 "))
    assert "bioptimus/H-optimus-0" in row and "4.5 GB" in row and "yes" in row
    assert all(f"{name} " in out for name, spec in registry.REGISTRY.items() if spec.hub_id)
