"""The remote backend against real Triton servers (PyTriton on the CPU) that the tests start:
slidesnake's own server (UINT8 input) and tests/remote/fp32_server.py (normalised FP32).

Needs the server's environment (`make serve-env`); skipped without it, unless
SLIDESNAKE_REQUIRE_SERVE=1 (CI) makes its absence a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO, embed_one
from safetensors.torch import save_file

from slidesnake.cli import main
from slidesnake.embed.job import embed_slide
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.settings import EmbedSettings, RemoteSettings
from slidesnake.embed.store import load_embeddings
from slidesnake.errors import ConfigError, RemoteError, RemoteRefusedError
from slidesnake.models.embedder import build_network
from slidesnake.models.registry import model_spec
from slidesnake.remote.served_run import ServedRun
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

pytestmark = pytest.mark.server

SERVE_PYTHON = Path(os.environ.get("SLIDESNAKE_SERVE_PYTHON", REPO / ".venv-serve/bin/python"))
TOKEN = "tok-7f3a91c2e5"  # the tests' bearer token: must never show up in an output


@pytest.fixture(scope="module")
def serve_python() -> Path:
    if not SERVE_PYTHON.is_file():
        if os.environ.get("SLIDESNAKE_REQUIRE_SERVE") == "1":
            pytest.fail(f"no server environment at {SERVE_PYTHON}: run `make serve-env`")
        pytest.skip("no server environment (make serve-env)")
    return SERVE_PYTHON


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Server:
    """A server process in its own session, so that a kill takes Triton down with it."""

    def __init__(self, args: list[str], log: Path, model: str) -> None:
        self.args, self.log, self.model = args, log, model
        self.ports = free_ports(3)
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        self.process: subprocess.Popen | None = None

    def start(self, attempts: int = 3) -> Server:
        """Start the server and wait for its model; PyTriton's handshake with its model
        sometimes fails on a loaded 2-core machine, so a server that dies starting is
        started again."""
        for _ in range(attempts):
            if self._started():
                return self
        raise AssertionError(f"server did not start:\n{self.log.read_text()[-3000:]}")

    def _started(self) -> bool:
        ports = [str(p) for p in self.ports]
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [*self.args, *self._port_args(ports)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/v2/models/{self.model}/ready").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.kill()
        return False

    def _port_args(self, ports: list[str]) -> list[str]:
        if "slidesnake.serve" in self.args:
            return ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
        return ["--ports", *ports]

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Stop the server's session; then remove the shared memory its processes had
        mapped, which PyTriton leaves in /dev/shm when killed (hundreds of MB per run)."""
        mapped = self._shared_memory()
        with contextlib.suppress(ProcessLookupError):  # the whole group has gone already
            os.killpg(self.process.pid, sig)
        status = self.process.wait(timeout=60)
        for name in mapped:
            (Path("/dev/shm") / name).unlink(missing_ok=True)
        return status

    def _shared_memory(self) -> set[str]:
        names = set()
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if os.getsid(int(proc.name)) != self.process.pid:
                    continue
                for line in (proc / "maps").read_text().splitlines():
                    if "/dev/shm/" in line:
                        names.add(line.split("/dev/shm/", 1)[1].split()[0])
        return names


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Seeded random weights of timm's test ViT, as a safetensors file both backends load."""
    torch.manual_seed(3)
    network = build_network(model_spec("timm:test_vit"), 224).network
    path = tmp_path_factory.mktemp("weights") / "test_vit.safetensors"
    save_file({k: v.contiguous() for k, v in network.state_dict().items()}, str(path))
    return str(path)


@pytest.fixture(scope="module")
def rect_tiles(tmp_path_factory, rect_slide) -> Path:
    out = tmp_path_factory.mktemp("rect")
    args = (rect_slide, "rect", out / "mask.png", out / "qc_mask.png")
    make_tissue_mask(*args, TissueParams())
    make_tile_coords(*args, out / "tiles.parquet", out / "qc_tiles.png", TileParams())
    return out / "tiles.parquet"


@pytest.fixture(scope="module")
def uint8_server(serve_python, checkpoint, tmp_path_factory):
    """slidesnake's own server: the test ViT, UINT8 tiles in."""
    log = tmp_path_factory.mktemp("uint8-server") / "server.log"
    args = [str(serve_python), "-m", "slidesnake.serve", "--model", "timm:test_vit"]
    args += ["--checkpoint", checkpoint, "--precision", "fp32", "--device", "cpu"]
    args += ["--tile-size", "224", "--name", "test_vit"]
    server = Server(args, log, "test_vit").start()
    yield server
    assert server.kill(signal.SIGTERM) == 0, log.read_text()[-2000:]  # a clean shutdown


def fp32_server(serve_python, checkpoint, workdir: Path, delay_s: float = 0.0) -> Server:
    args = [str(serve_python), str(REPO / "tests" / "remote" / "fp32_server.py")]
    args += ["--checkpoint", checkpoint, "--stats", str(workdir / "stats.json")]
    args += ["--delay-s", str(delay_s)]
    return Server(args, workdir / "server.log", "fp32")


@pytest.fixture(scope="module")
def slow_fp32_server(serve_python, checkpoint, tmp_path_factory):
    server = fp32_server(serve_python, checkpoint, tmp_path_factory.mktemp("fp32"), 0.2).start()
    yield server
    server.kill()


def stats(server: Server) -> dict:
    path = server.log.parent / "stats.json"
    return json.loads(path.read_text()) if path.exists() else {"requests": 0, "max_in_flight": 0}


def remote_settings(url: str, model: str, **remote) -> EmbedSettings:
    values = {"max_concurrency": 2, "batch_size": 8, "timeout_s": 30, "retries": 2} | remote
    return EmbedSettings(
        model="timm:test_vit",
        precision="fp32",
        output_dtype="float32",
        workers=1,
        backend="remote",
        remote=RemoteSettings(url=url, model=model, **values),
    )


def embed_remote(slide, tiles, out: Path, settings: EmbedSettings):
    out.mkdir(parents=True, exist_ok=True)
    metrics = embed_one(
        slide, "rect", tiles, out / "embeddings.zarr", out / "metrics.json", settings,
        open_served=ServedRun,
    )  # fmt: skip
    return (*load_embeddings(out / "embeddings.zarr"), metrics)


@pytest.fixture(scope="module")
def local_features(tmp_path_factory, rect_slide, rect_tiles, checkpoint):
    out = tmp_path_factory.mktemp("local")
    settings = EmbedSettings(
        model="timm:test_vit", checkpoint=checkpoint, precision="fp32",
        output_dtype="float32", workers=1, batch_size=8,
    )  # fmt: skip
    embed_one(rect_slide, "rect", rect_tiles, out / "e.zarr", out / "m.json", settings)
    features, coords, _ = load_embeddings(out / "e.zarr")
    return features, coords


def test_slidesnake_serve_gives_the_local_backends_features(
    tmp_path, rect_slide, rect_tiles, uint8_server, local_features
):
    features, coords, attrs, metrics = embed_remote(
        rect_slide, rect_tiles, tmp_path, remote_settings(uint8_server.url, "test_vit")
    )
    np.testing.assert_array_equal(coords, local_features[1])
    np.testing.assert_allclose(features, local_features[0], rtol=1e-4, atol=1e-4)
    assert attrs["backend"] == "remote" and attrs["server_model"] == "test_vit"
    assert metrics["backend"] == "remote" and metrics["tiles"] == len(coords) == 80
    assert metrics["requests"] >= 10 and metrics["latency_p50_s"] > 0
    assert metrics["retries"] == 0 and metrics["server_model_versions"] == ["1"]


def test_the_command_line_embeds_on_a_server_as_the_job_does(
    tmp_path, rect_slide, rect_tiles, uint8_server, local_features
):
    """`slidesnake embed --url`: the served model's features, recorded as served."""
    main(
        ["embed", str(rect_slide), str(rect_tiles), str(tmp_path), "--url", uint8_server.url,
         "--server-model", "test_vit", "--model", "timm:test_vit", "--precision", "fp32",
         "--output-dtype", "float32", "--batch-size", "8", "--max-concurrency", "2"]
    )  # fmt: skip
    features, coords, attrs = load_embeddings(tmp_path / "embeddings.zarr")
    np.testing.assert_array_equal(coords, local_features[1])
    np.testing.assert_allclose(features, local_features[0], rtol=1e-4, atol=1e-4)
    assert attrs["backend"] == "remote" and attrs["server_model"] == "test_vit"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["tiles"] == 80 and metrics["requests"] >= 10  # batches of 8


def test_a_normalised_fp32_server_gives_the_local_backends_features(
    tmp_path, rect_slide, rect_tiles, slow_fp32_server, local_features
):
    settings = remote_settings(slow_fp32_server.url, "fp32", max_concurrency=4)
    features, coords, attrs, _ = embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    np.testing.assert_array_equal(coords, local_features[1])
    np.testing.assert_allclose(features, local_features[0], rtol=1e-4, atol=1e-4)
    assert "FP32 [-1, 3, 224, 224]" in attrs["server_io"]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_server_never_holds_more_requests_than_max_concurrency(
    tmp_path, rect_slide, rect_tiles, serve_python, checkpoint, concurrency
):
    server = fp32_server(serve_python, checkpoint, tmp_path, delay_s=0.2).start()
    try:
        settings = remote_settings(server.url, "fp32", max_concurrency=concurrency)
        embed_remote(rect_slide, rect_tiles, tmp_path / "out", settings)
    finally:
        server.kill()
    seen = stats(server)
    assert seen["requests"] >= 10
    assert seen["max_in_flight"] <= concurrency
    if concurrency > 1:
        assert seen["max_in_flight"] > 1


def kill_when_busy(server: Server, requests: int) -> threading.Thread:
    def watch() -> None:
        while stats(server)["requests"] < requests:
            time.sleep(0.05)
        server.kill()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_mid_slide_fails_the_slide_with_the_url_and_last_error(
    tmp_path, rect_slide, rect_tiles, serve_python, checkpoint
):
    server = fp32_server(serve_python, checkpoint, tmp_path, delay_s=0.2).start()
    watcher = kill_when_busy(server, 3)
    settings = remote_settings(server.url, "fp32", max_concurrency=1, retries=2)
    with pytest.raises(RemoteError, match="failed after 3 attempts") as error:
        embed_remote(rect_slide, rect_tiles, tmp_path / "out", settings)
    watcher.join()
    assert server.url in str(error.value) and "ConnectError" in str(error.value)
    assert not (tmp_path / "out" / "embeddings.zarr").exists()  # nothing half-written


def test_a_server_restarted_within_the_retries_finishes_the_slide(
    tmp_path, rect_slide, rect_tiles, serve_python, checkpoint, local_features
):
    server = fp32_server(serve_python, checkpoint, tmp_path, delay_s=0.2).start()
    watcher = kill_when_busy(server, 3)

    def restart() -> None:
        watcher.join()
        server.start()

    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    # retries 7: at least 0.25 + 0.5 + ... + 16 s = 31 s of backoff, longer than a restart
    settings = remote_settings(server.url, "fp32", max_concurrency=1, retries=7)
    try:
        features, _, _, metrics = embed_remote(rect_slide, rect_tiles, tmp_path / "out", settings)
    finally:
        restarter.join()
        server.kill()
    assert metrics["retries"] > 0
    np.testing.assert_allclose(features, local_features[0], rtol=1e-4, atol=1e-4)


class Gateway(BaseHTTPRequestHandler):
    """A bearer-token gateway in front of a server, as sites put one in front of Triton."""

    upstream = ""
    faults: ClassVar[list[int]] = []  # statuses to answer the next inference requests with

    def _forward(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._answer(401)
            return
        if self.path.endswith("/infer") and self.faults:
            self._answer(self.faults.pop(0))
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        answer = httpx.request(self.command, self.upstream + self.path, content=body,
                               headers=headers)  # fmt: skip
        self.send_response(answer.status_code)
        for key in ("Content-Type", "Inference-Header-Content-Length"):
            if key in answer.headers:
                self.send_header(key, answer.headers[key])
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def _answer(self, status: int) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway(uint8_server):
    Gateway.upstream = uint8_server.url
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_token_is_sent_and_never_written(
    tmp_path, rect_slide, rect_tiles, gateway, monkeypatch, caplog
):
    monkeypatch.setenv("SLIDE_TOKEN", TOKEN)
    settings = remote_settings(gateway, "test_vit", token_env="SLIDE_TOKEN")
    embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "metrics.json" for p in written)
    assert not [p for p in written if TOKEN.encode() in p.read_bytes()]
    assert TOKEN not in caplog.text


def test_busy_and_failing_answers_are_retried_and_retry_after_is_honoured(
    tmp_path, rect_slide, rect_tiles, gateway, monkeypatch
):
    monkeypatch.setenv("SLIDE_TOKEN", TOKEN)
    Gateway.faults = [429, 503, 502]
    settings = remote_settings(gateway, "test_vit", token_env="SLIDE_TOKEN", retries=3,
                               max_concurrency=1)  # fmt: skip
    started = time.monotonic()
    *_, metrics = embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    assert metrics["retries"] == 3 and metrics["tiles"] == 80
    assert time.monotonic() - started > 1.0  # the 429's Retry-After: 1


def test_a_request_too_large_says_to_lower_the_batch_size(
    tmp_path, rect_slide, rect_tiles, gateway, monkeypatch
):
    monkeypatch.setenv("SLIDE_TOKEN", TOKEN)
    Gateway.faults = [413]
    settings = remote_settings(gateway, "test_vit", token_env="SLIDE_TOKEN", max_concurrency=1)
    with pytest.raises(
        RemoteError,
        match=r"refused a request of 8 tiles as too large \(HTTP 413\); lower remote.batch_size",
    ):
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    assert not (tmp_path / "embeddings.zarr").exists()


def test_a_refused_token_fails_at_once_naming_the_variable_not_the_token(
    tmp_path, rect_slide, rect_tiles, gateway, monkeypatch
):
    monkeypatch.setenv("SLIDE_TOKEN", "wrong-" + TOKEN)
    settings = remote_settings(gateway, "test_vit", token_env="SLIDE_TOKEN", retries=5)
    started = time.monotonic()
    with pytest.raises(RemoteRefusedError, match=r"refused the token in \$SLIDE_TOKEN \(HTTP 401"):
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    assert time.monotonic() - started < 5  # not retried
    with pytest.raises(RemoteRefusedError) as error:
        embed_remote(rect_slide, rect_tiles, tmp_path, remote_settings(gateway, "test_vit"))
    assert "without a token (set remote.token_env)" in str(error.value)
    assert TOKEN not in str(error.value)


def test_an_unknown_model_is_a_config_error(tmp_path, rect_slide, rect_tiles, uint8_server):
    settings = remote_settings(uint8_server.url, "uni", ready_timeout_s=2)
    # PyTriton keeps Triton's repository index (which lists the models) behind its own token
    with pytest.raises(ConfigError, match=r"has no model 'uni' ready.*; check remote.model"):
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)


@pytest.mark.parametrize(
    ("model_name", "served", "message"),
    [
        ("h-optimus-0", "test_vit", "'h-optimus-0' gives 1536-d features, the server 64"),
        ("timm:test_vit", "nhwc_fp32", r"sends tiles as UINT8 \[-1, H, W, 3\] or normalised"),
    ],
)
def test_a_model_that_does_not_fit_is_a_config_error_before_any_tile_is_read(
    tmp_path, rect_slide, rect_tiles, uint8_server, slow_fp32_server, model_name, served, message
):
    url = uint8_server.url if served == "test_vit" else slow_fp32_server.url
    settings = remote_settings(url, served)
    settings = EmbedSettings(**{**settings.__dict__, "model": model_name})
    with pytest.raises(ConfigError, match=message) as error:
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    assert url in str(error.value) and f"'{served}'" in str(error.value)


def test_a_server_that_never_answers_fails_on_the_timeout(tmp_path, rect_slide, rect_tiles):
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    settings = remote_settings(url, "test_vit", timeout_s=1)
    with pytest.raises(RemoteError, match=r"did not answer within remote.timeout_s \(1 s\)"):
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)
    listener.close()


def test_a_server_that_is_not_there_fails_after_the_ready_timeout(tmp_path, rect_slide, rect_tiles):
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    settings = remote_settings(url, "test_vit", ready_timeout_s=1)
    with pytest.raises(RemoteError, match=r"server was not ready within remote.ready_timeout_s"):
        embed_remote(rect_slide, rect_tiles, tmp_path, settings)


@pytest.mark.workflow
def test_a_cohort_outlives_its_server_being_killed_mid_slide(
    workflow, rect_slide, serve_python, checkpoint, tmp_path
):
    """One slide's job loses the server and fails with its line; the server comes back and
    the other slides finish. The embedding jobs hold an endpoint slot each, no GPU."""
    server = fp32_server(serve_python, checkpoint, tmp_path, delay_s=0.2).start()
    config = yaml.safe_load((workflow.dir / "config" / "config.yaml").read_text())
    config["model"] |= {"backend": "remote", "checkpoint": None, "weights": "checkpoint"}
    config["remote"] |= {"url": server.url, "model": "fp32", "batch_size": 8, "retries": 1,
                         "max_concurrency": 2, "ready_timeout_s": 120}  # fmt: skip
    (workflow.dir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    slides = [("a", rect_slide), ("b", rect_slide), ("c", rect_slide)]
    workflow.sheet(slides)

    dry = workflow.run("-n", "--resources", "endpoint=1")
    assert "endpoint=1" in dry.stdout and "gpu=1" not in dry.stdout

    killer = kill_when_busy(server, 3)

    def restart_after_a_failure() -> None:
        killer.join()
        logs = workflow.dir / "logs" / "slides"
        while not any(" ERROR " in p.read_text() for p in logs.glob("*/embed_tiles.log")):
            time.sleep(0.2)
        server.start()

    restarter = threading.Thread(target=restart_after_a_failure, daemon=True)
    restarter.start()
    try:
        result = workflow.run("--resources", "endpoint=1", check=False)
    finally:
        restarter.join(timeout=60)
        server.kill()
    assert result.returncode != 0
    table = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t", index_col="slide_id")
    failed = table[table["status"] == "failed"]
    assert len(failed) == 1 and set(table["status"]) == {"done", "failed"}
    assert f"inference server {server.url} failed after 2 attempts" in failed["reason"].iloc[0]
    for slide_id in table.index[table["status"] == "done"]:
        metrics = json.loads(workflow.result(slide_id, "metrics.json").read_text())
        assert metrics["backend"] == "remote" and metrics["tiles"] == 80


def test_a_served_model_of_a_model_list_shares_the_one_read(
    tmp_path, rect_slide, rect_tiles, uint8_server, local_features, checkpoint
):
    here = EmbedSettings(
        model="timm:test_vit", checkpoint=checkpoint, precision="fp32",
        output_dtype="float32", workers=1, batch_size=8,
    )  # fmt: skip
    models = {"here": here, "served": remote_settings(uint8_server.url, "test_vit")}
    out = {k: ModelOutputs(tmp_path / k / "e.zarr", tmp_path / k / "m.json") for k in models}
    params = {key: {"model": key} for key in models}  # what the job records as current
    metrics = embed_slide(
        rect_slide, "rect", rect_tiles, out, models, params, open_served=ServedRun
    )
    features, coords, _ = load_embeddings(out["here"].zarr)
    np.testing.assert_array_equal(features, local_features[0])
    served, served_coords, attrs = load_embeddings(out["served"].zarr)
    np.testing.assert_array_equal(served_coords, coords)
    np.testing.assert_allclose(served, local_features[0], rtol=1e-4, atol=1e-4)
    assert attrs["model_key"] == "served" and attrs["server_model"] == "test_vit"
    assert metrics["served"]["backend"] == "remote" and metrics["served"]["requests"] == 10
    decoded = {m["compressed_tiles_decoded"] for m in metrics.values()}
    assert len(decoded) == 1 and decoded.pop() > 0  # one read for both
