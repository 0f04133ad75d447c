"""Real stores on loopback for the storage tests and benchmark: moto's standalone S3
server, and a small HTTP server that honours Range requests and can misbehave on purpose
(refuse, drop connections mid-answer)."""

from __future__ import annotations

import email.utils
import functools
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

# Credentials moto accepts; the secret is a marker the tests look for in every file written.
SECRET = "s3cr3t-never-written-anywhere"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "slidesnake-test-key",
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
}


# Connections a /flaky/ path drops before it answers.
FLAKY = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server in its own process; objects put through boto3."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server = Path(sys.executable).with_name("moto_server")
        self._process = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **S3_ENV},
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(self.url, timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("moto_server did not start")
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.url, **_boto_credentials())

    def put(self, bucket: str, key: str, path: Path | bytes) -> str:
        """Put `path` (or bytes) as s3://bucket/key, making the bucket; return the URL."""
        with suppress(self.client.exceptions.BucketAlreadyOwnedByYou):
            self.client.create_bucket(Bucket=bucket)
        body = path if isinstance(path, bytes) else Path(path).read_bytes()
        self.client.put_object(Bucket=bucket, Key=key, Body=body)
        return f"s3://{bucket}/{key}"

    @property
    def storage(self) -> dict:
        """The `storage:` section that reads from this server."""
        return {"s3": {"endpoint_url": self.url}}

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"],
    }


class LoopbackServer:
    """An HTTP server on loopback answering with `handler`, a thread per connection."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RangeServer(LoopbackServer):
    """An HTTP server of a folder's files, with Range requests, ETag and Last-Modified.

    Misbehaviour by path prefix: /forbidden/... answers 403; /norange/... answers every
    GET with the whole file, as a server without Range support does; /flaky/... drops the
    connection mid-answer on the server's first `FLAKY` GETs with a Range; /dropping/...
    on every one. A hostile server's (see HOSTILE): /gzip/... gzips each range (a bomb),
    /endless/... sends a body without end, /overlong/... declares 2 GiB for any range,
    /drip/... sends a byte every half second, /nohead/... never answers a HEAD. Only
    /pinned/... honours If-Match (412): elsewhere the answer's ETag is what tells a
    replaced file. `replace_after(name, n, data)` replaces a file as its n-th ranged GET
    arrives; `turn_after(name, n, mode)` answers as HOSTILE[mode] from its n-th on (the
    index read honestly, the tiles not). `requests` counts the GETs with a Range."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.requests = 0
        self._lock = threading.Lock()
        self._replacements: dict[str, tuple[int, bytes]] = {}
        self._turns: dict[str, tuple[int, str]] = {}
        self._seen: dict[str, int] = {}
        super().__init__(self._handler())

    def add(self, path: Path, name: str | None = None) -> str:
        """Serve a copy of `path` as /name; return its URL."""
        target = self.root / (name or Path(path).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        return f"{self.url}/{name or Path(path).name}"

    def replace_after(self, name: str, ranged_gets: int, data: bytes) -> None:
        """Replace /name with `data` (a new ETag) when its `ranged_gets`-th GET arrives."""
        self._replacements[name] = (ranged_gets, data)

    def turn_after(self, name: str, ranged_gets: int, mode: str) -> None:
        """Answer /name's ranged GETs as HOSTILE[mode] from the `ranged_gets`-th on."""
        self._turns[name] = (ranged_gets, mode)

    def _count(self, name: str) -> tuple[int, str | None]:
        """This ranged GET's number, and the hostile mode it is answered in, if any."""
        with self._lock:
            self.requests += 1
            seen = self._seen.get(name, 0) + 1
            self._seen[name] = seen
            replacing = self._replacements.get(name)
            if replacing is not None and seen >= replacing[0]:
                del self._replacements[name]
                target = self.root / name
                target.write_bytes(replacing[1])
                os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
            turn = self._turns.get(name)
            return self.requests, turn[1] if turn is not None and seen >= turn[0] else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(_HostileAnswers):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                if self.path.startswith("/nohead/"):
                    time.sleep(3600)
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                parts = self.path.lstrip("/").split("/", 1)
                if parts[0] == "forbidden":
                    return self._status(403)
                if parts[0] == "endless" and "Range" not in self.headers:
                    return self._endless(status=200)  # a metadata answer (DICOMweb JSON)
                file = server.root / self.path.lstrip("/")
                if not file.is_file():
                    return self._status(404)
                ranged = self.headers.get("Range", "").startswith("bytes=")
                ranged = ranged and parts[0] != "norange"
                if ranged and body:
                    number, turned = server._count(self.path.lstrip("/"))
                    drop = {"dropping": True, "flaky": number <= FLAKY}.get(parts[0], False)
                    if drop:
                        return self._drop(self._wanted(file)[1] - self._wanted(file)[0])
                    mode = turned or parts[0]
                    if mode in HOSTILE:
                        return HOSTILE[mode](self, file)
                status = file.stat()
                etag = f'"{status.st_size:x}-{status.st_mtime_ns:x}"'
                if parts[0] == "pinned" and self.headers.get("If-Match", etag) != etag:
                    return self._status(412)
                start, end = self._wanted(file) if ranged else (0, status.st_size)
                claimed = 10**15 if parts[0] == "huge" else status.st_size  # a lying HEAD
                if start >= status.st_size and ranged:
                    return self._status(416)
                self.send_response(206 if ranged else 200)
                length = end - start if ranged or body else claimed
                self.send_header("Content-Length", str(length))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{claimed}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", etag)
                mtime = email.utils.formatdate(status.st_mtime, usegmt=True)
                self.send_header("Last-Modified", mtime)
                self.end_headers()
                if body:
                    with file.open("rb") as f:
                        f.seek(start)
                        self.wfile.write(f.read(end - start))

            def _wanted(self, file: Path) -> tuple[int, int]:
                size = file.stat().st_size
                first, _, last = self.headers["Range"][6:].partition("-")
                return int(first), min(int(last) + 1 if last else size, size)

            def _drop(self, length: int) -> None:
                """Promise `length` bytes, send a few, hang up."""
                self.send_response(206)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(b"\0" * min(10, length // 2))
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

            def _status(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


class _HostileAnswers(BaseHTTPRequestHandler):
    """What a hostile server answers to a byte range: each sends until the client goes."""

    def _gzip(self, file: Path) -> None:
        bomb = _gzip_bomb()
        self.send_response(206)
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(bomb)))
        self.end_headers()
        self._send_quietly([bomb])

    def _endless(self, file: Path | None = None, status: int = 206) -> None:
        self.send_response(status)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"[" + b'{"00080018": {"vr": "UI", "Value": ["1.2.3"]}},' * 1000
        framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        self._send_quietly(iter(lambda: framed, None))

    def _overlong(self, file: Path) -> None:
        self.send_response(206)
        self.send_header("Content-Length", str(2 << 30))
        self.end_headers()
        self._send_quietly(iter(lambda: b"\0" * (1 << 20), None))

    def _drip(self, file: Path) -> None:
        first, _, last = self.headers["Range"][6:].partition("-")
        self.send_response(206)
        self.send_header("Content-Length", str(int(last) + 1 - int(first)))
        self.end_headers()
        self._send_quietly(_dripping())

    def _send_quietly(self, chunks) -> None:
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError:  # the client hung up: what a bounded client does
            self.close_connection = True


@functools.cache
def _gzip_bomb() -> bytes:
    """2 MB of gzip members that inflate to 2 GiB of zeros."""
    return gzip.compress(b"\0" * (64 << 20), compresslevel=9) * 32


def _dripping():
    while True:
        time.sleep(0.5)
        yield b"\0"


HOSTILE = {
    "gzip": _HostileAnswers._gzip,
    "endless": _HostileAnswers._endless,
    "overlong": _HostileAnswers._overlong,
    "drip": _HostileAnswers._drip,
}


class DripProxy(LoopbackServer):
    """A proxy in front of `upstream` (a DICOMweb server) that answers as it does, but
    drips the body of any answer whose path holds `slow` a byte every half second."""

    def __init__(self, upstream: str, slow: str = "/frames/") -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                answer = requests.get(upstream + self.path, headers=headers, timeout=30)
                self.send_response(answer.status_code)
                for name in ("Content-Type", "ETag"):
                    if name in answer.headers:
                        self.send_header(name, answer.headers[name])
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                if slow not in self.path:
                    self.wfile.write(answer.content)
                    return
                with suppress(OSError):
                    for byte in _dripping():
                        self.wfile.write(byte)
                        self.wfile.flush()
                self.close_connection = True

        super().__init__(Handler)


class SilentServer:
    """A host that accepts connections and never says a word."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with suppress(OSError):
            while True:
                self._held.append(self._socket.accept()[0])

    def stop(self) -> None:
        self._socket.close()
        for connection in self._held:
            connection.close()


@contextmanager
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


ORTHANC_PLUGINS = ("/usr/share/orthanc/plugins", "/usr/lib/orthanc/plugins")


def orthanc_binary() -> str | None:
    """Orthanc and its DICOMweb plugin (Debian: orthanc, orthanc-dicomweb), or None."""
    binary = shutil.which("Orthanc") or shutil.which("Orthanc", path="/usr/sbin")
    return binary if binary and _dicomweb_plugin() else None


def _dicomweb_plugin() -> str | None:
    found = [Path(d) / "libOrthancDicomWeb.so" for d in ORTHANC_PLUGINS]
    return next((str(p) for p in found if p.is_file()), None)


class OrthancServer:
    """Orthanc with its DICOMweb plugin, on loopback, storing under `root`."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "Name": "slidesnake-tests",
            "StorageDirectory": str(root / "storage"),
            "IndexDirectory": str(root / "storage"),
            "HttpPort": self.port,
            "DicomServerEnabled": False,
            "RemoteAccessAllowed": False,
            "AuthenticationEnabled": False,
            "Plugins": [_dicomweb_plugin()],
            "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
        }
        path = root / "orthanc.json"
        path.write_text(json.dumps(config))
        self._process = subprocess.Popen(
            [orthanc_binary(), str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/system", timeout=1).ok:
                    return
            except requests.ConnectionError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("Orthanc did not start")

    def add(self, paths: list[Path]) -> str:
        """Store these instances; return the DICOMweb URL of their series."""
        for path in paths:
            requests.post(
                f"{self.url}/instances", data=path.read_bytes(), timeout=30
            ).raise_for_status()
        import pydicom

        ds = pydicom.dcmread(paths[0], stop_before_pixels=True)
        return f"{self.url}/dicom-web/studies/{ds.StudyInstanceUID}/series/{ds.SeriesInstanceUID}"

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)
