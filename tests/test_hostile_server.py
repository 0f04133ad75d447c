"""A hostile inference server: answers of the wrong shape or datatype, values that are not
finite, malformed headers, an answer dripped a byte at a time, bodies far larger than a
batch can need, and secrets echoed back. Each fails the slide with one short line, within
a bound; nothing is written that looks finished, and no secret reaches any line.

The server is a plain HTTP server speaking just enough of the Open Inference Protocol to
misbehave in one way per test: a real server answering what a broken or hostile one would.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from conftest import embed_one

from slidesnake.embed.settings import EmbedSettings, RemoteSettings
from slidesnake.errors import NonFiniteError, RemoteError, RemoteProtocolError
from slidesnake.remote.served_run import ServedRun
from slidesnake.slides.synthetic import Rect, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

WIDTH = 192
TOKEN = "tok-hostile-4b1d9e"
PASSWORD = "pw-hostile-77c2"


class Hostile(BaseHTTPRequestHandler):
    """Declares UINT8 [-1, 224, 224, 3] -> FP32 [-1, 192]; answers as `mode` says."""

    mode: ClassVar[str] = "honest"

    def log_message(self, *args) -> None:  # the test's output stays readable
        pass

    def do_GET(self) -> None:
        if self.path.endswith("/ready"):
            self._send(200, b"")
            return
        metadata = {
            "name": "m", "versions": ["1"], "platform": "hostile",
            "inputs": [{"name": "tiles", "datatype": "UINT8", "shape": [-1, 224, 224, 3]}],
            "outputs": [{"name": "features", "datatype": "FP32", "shape": [-1, WIDTH]}],
        }  # fmt: skip
        self._send(200, json.dumps(metadata).encode())

    def do_POST(self) -> None:
        request = self.rfile.read(int(self.headers["Content-Length"]))
        split = int(self.headers["Inference-Header-Content-Length"])
        batch = json.loads(request[:split])["inputs"][0]["shape"][0]
        mode = self.mode
        if mode == "echo":
            echoed = "".join(f"{k}: {v}\n" for k, v in self.headers.items())
            self._send(400, f"bad request; you sent:\n{echoed}".encode())
            return
        if mode == "huge":
            self.send_response(200)
            self.send_header("Content-Length", str(300 << 20))
            self.end_headers()
            self.wfile.write(b"{" * 1024)
            return
        width, datatype, dtype = WIDTH, "FP32", np.float32
        values = np.full((batch, WIDTH), 0.5)
        if mode == "narrow":
            width = 1
        elif mode == "wide":
            width = 2 * WIDTH
        elif mode == "uint8":
            datatype, dtype = "UINT8", np.uint8
        elif mode in ("nan", "inf", "large"):
            values[0, 0] = {"nan": np.nan, "inf": np.inf, "large": 1e6}[mode]
        data = np.ascontiguousarray(np.resize(values, (batch, width)), dtype).tobytes()
        output = {"name": "features", "datatype": datatype, "shape": [batch, width],
                  "parameters": {"binary_data_size": len(data)}}  # fmt: skip
        header = json.dumps({"outputs": [output]}).encode()
        length = str(len(header))
        if mode == "bad_length":
            # 8 KB of binary that HTTP still carries as a header value.
            length = "".join(map(chr, [*range(0x21, 0x7F), *range(0x80, 0x100)])) * 37
        if mode == "drip":
            self.send_response(200)
            self.send_header("Inference-Header-Content-Length", length)
            self.send_header("Content-Length", str(len(header + data)))
            self.end_headers()
            for byte in header + data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.3)
            return
        self._send(200, header + data, {"Inference-Header-Content-Length": length})

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            try:
                self.send_header(key, value)
            except UnicodeEncodeError:
                self._headers_buffer.append(f"{key}: ".encode() + value.encode("latin-1") + b"\r\n")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
            self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def tiled(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("tiled")
    slide = write_slide(out / "s.svs", 1344, 1344, [Rect(0, 0, 1344, 1344)], mpp=0.5, levels=1)
    make_tissue_mask(slide, "s", out / "mask.png", out / "qc.png", TissueParams())
    make_tile_coords(slide, "s", out / "mask.png", out / "qc.png", out / "tiles.parquet",
                     out / "qc_tiles.png", TileParams())  # fmt: skip
    return slide, out / "tiles.parquet"


def settings(url: str, **remote) -> EmbedSettings:
    values = {"max_concurrency": 2, "batch_size": 8, "timeout_s": 5, "retries": 0,
              "ready_timeout_s": 5} | remote  # fmt: skip
    return EmbedSettings(model="custom", output_dtype="float16", workers=1, backend="remote",
                         remote=RemoteSettings(url=url, model="m", **values))  # fmt: skip


def embed(tiled, tmp_path, mode: str, **remote) -> Path:
    slide, tiles = tiled
    Hostile.mode = mode
    zarr = tmp_path / "embeddings.zarr"
    served = settings(f"http://{remote.pop('host', '')}", **remote)
    embed_one(slide, "s", tiles, zarr, tmp_path / "metrics.json", served, open_served=ServedRun)
    return zarr


@pytest.mark.parametrize(
    ("mode", "error", "problem"),
    [
        ("narrow", RemoteProtocolError, "answered features of shape (8, 1) for (8, 192)"),
        ("wide", RemoteProtocolError, "answered features of shape (8, 384) for (8, 192)"),
        ("uint8", RemoteProtocolError, "answered UINT8 features where its metadata declares FP32"),
        ("nan", NonFiniteError, "tile features (float16) hold 1 NaN or infinite values"),
        ("inf", NonFiniteError, "tile features (float16) hold 1 NaN or infinite values"),
        ("large", NonFiniteError, "tile features (float16) hold 1 NaN or infinite values"),
        ("bad_length", RemoteProtocolError, "malformed inference response"),
    ],
)
def test_an_answer_that_is_not_what_the_server_declares_fails_the_slide(
    tiled, tmp_path, server, mode, error, problem
):
    with pytest.raises(error) as raised:
        embed(tiled, tmp_path, mode, host=server)
    message = str(raised.value)
    assert problem in message, message
    assert len(message) < 600 and message.isprintable(), message
    assert not (tmp_path / "embeddings.zarr").exists()
    assert not (tmp_path / "metrics.json").exists()


def test_the_honest_server_embeds(tiled, tmp_path, server):
    assert embed(tiled, tmp_path, "honest", host=server).is_dir()


def test_an_answer_dripped_a_byte_at_a_time_is_bounded_by_the_timeout(tiled, tmp_path, server):
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"took longer than remote.timeout_s \(2 s\)"):
        embed(tiled, tmp_path, "drip", host=server, timeout_s=2)
    assert time.monotonic() - started < 15  # the whole answer would take ~5 minutes
    assert not (tmp_path / "embeddings.zarr").exists()


def test_a_body_larger_than_the_batch_can_need_is_refused_unread(tiled, tmp_path, server):
    started = time.monotonic()
    with pytest.raises(RemoteProtocolError, match="answered 314,572,800 bytes or more, more than"):
        embed(tiled, tmp_path, "huge", host=server)
    assert time.monotonic() - started < 10


JOB = """
import sys
from pathlib import Path
from slidesnake.cohort.jobs import run_job
from slidesnake.embed.job import embed_slide
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.settings import EmbedSettings, RemoteSettings
from slidesnake.remote.served_run import ServedRun
remote = RemoteSettings(url=sys.argv[1], model="m", batch_size=8, timeout_s=5, retries=1,
                        ready_timeout_s=5, token_env="HOSTILE_TOKEN")
settings = EmbedSettings(model="custom", workers=1, backend="remote", remote=remote)
out = sys.argv[4]
outputs = {"model": ModelOutputs(Path(out, "embeddings.zarr"), Path(out, "metrics.json"))}
run_job(lambda: embed_slide(sys.argv[2], "s", sys.argv[3], outputs, {"model": settings},
                            open_served=ServedRun),
        log_path=out + "/embed_tiles.log", slide_id="s")
"""


@pytest.mark.parametrize("credentials", ["token", "password"])
def test_no_secret_reaches_a_line_whatever_the_server_echoes(tiled, tmp_path, server, credentials):
    slide, tiles = tiled
    Hostile.mode = "echo"
    url = f"http://user:{PASSWORD}@{server}" if credentials == "password" else f"http://{server}"
    result = subprocess.run(
        [sys.executable, "-c", JOB, url, str(slide), str(tiles), str(tmp_path)],
        capture_output=True, text=True, env={"HOSTILE_TOKEN": TOKEN, "PATH": "/usr/bin"},
    )  # fmt: skip
    assert result.returncode == 1
    log = (tmp_path / "embed_tiles.log").read_text()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "refused a request (HTTP 400: bad request; you sent:" in errors[0]
    scheme = "Basic" if credentials == "password" else "Bearer"
    assert f"Authorization: {scheme} ***" in errors[0], errors[0]
    for text in (log, result.stderr, result.stdout):
        assert TOKEN not in text and PASSWORD not in text
        assert "dXNlcjpwdy1ob3N0aWxlLTc3YzI" not in text  # base64 of user:password
    assert "HTTP Request:" not in result.stderr  # the HTTP client's own request lines
