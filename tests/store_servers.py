"""Real stores on loopback for the storage tests and benchmark: moto's standalone S3
server, and a small HTTP server that honours Range requests and can misbehave on purpose
(refuse, drop connections mid-answer)."""

from __future__ import annotations

import email.utils
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


class RangeServer:
    """An HTTP server of a folder's files, with Range requests, ETag and Last-Modified.

    Misbehaviour by path prefix: /forbidden/... answers 403; /norange/... answers every
    GET with the whole file, as a server without Range support does; /flaky/... drops the
    connection mid-answer on the server's first `FLAKY` GETs with a Range; /dropping/...
    on every one. `requests` counts the GETs with a Range."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add(self, path: Path, name: str | None = None) -> str:
        """Serve a copy of `path` as /name; return its URL."""
        target = self.root / (name or Path(path).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        return f"{self.url}/{name or Path(path).name}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self) -> int:
        with self._lock:
            self.requests += 1
            return self.requests

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                parts = self.path.lstrip("/").split("/", 1)
                if parts[0] == "forbidden":
                    return self._status(403)
                file = server.root / self.path.lstrip("/")
                if not file.is_file():
                    return self._status(404)
                size = file.stat().st_size
                start, end = 0, size
                ranged = self.headers.get("Range", "").startswith("bytes=")
                ranged = ranged and parts[0] != "norange"
                if ranged:
                    first, _, last = self.headers["Range"][6:].partition("-")
                    start, end = int(first), min(int(last) + 1 if last else size, size)
                    number = server._count() if body else 0
                    drop = {"dropping": True, "flaky": number <= FLAKY}.get(parts[0], False)
                    if body and drop:
                        return self._drop(end - start)
                self.send_response(206 if ranged else 200)
                self.send_header("Content-Length", str(end - start))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.send_header("Accept-Ranges", "bytes")
                status = file.stat()
                self.send_header("ETag", f'"{status.st_size:x}-{status.st_mtime_ns:x}"')
                mtime = email.utils.formatdate(status.st_mtime, usegmt=True)
                self.send_header("Last-Modified", mtime)
                self.end_headers()
                if body:
                    with file.open("rb") as f:
                        f.seek(start)
                        self.wfile.write(f.read(end - start))

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
