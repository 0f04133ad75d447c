"""How a job waits for its inference server: through a server that is not up yet, one that
says it is ready before it has loaded its model, and one whose readiness drops while it
loads (Triton's does). A model is only called missing once the server has said it is ready
for the grace period on end. A plain HTTP server plays each phase of a start-up."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from slidesnake.embed.settings import RemoteSettings
from slidesnake.errors import ConfigError, RemoteError
from slidesnake.remote import client as client_module
from slidesnake.remote.client import InferenceClient

GRACE_S = 0.6


class StartingServer(BaseHTTPRequestHandler):
    """Answers /v2/health/ready and /v2/models/m/ready by the phase of its start-up:
    `phases` lists (until_s, server_status, model_status) from when it began listening."""

    phases: ClassVar[list[tuple[float, int, int]]] = []
    began: ClassVar[float] = 0.0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        elapsed = time.monotonic() - self.began
        server, model = next(
            ((s, m) for until, s, m in self.phases if elapsed < until), self.phases[-1][1:]
        )
        status = server if self.path == "/v2/health/ready" else model
        if self.path not in ("/v2/health/ready", "/v2/models/m/ready"):
            status = 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(autouse=True)
def short_grace(monkeypatch) -> None:
    monkeypatch.setattr(client_module, "MODEL_GRACE_S", GRACE_S)


@contextlib.contextmanager
def serve_later(phases: list[tuple[float, int, int]], delay_s: float) -> Iterator[str]:
    """A URL nothing listens on until `delay_s`, then a server going through `phases`."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    handler = type("Phased", (StartingServer,), {"phases": phases})
    servers: list[ThreadingHTTPServer] = []

    def start() -> None:
        time.sleep(delay_s)
        handler.began = time.monotonic()
        httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        servers.append(httpd)
        httpd.serve_forever(poll_interval=0.05)

    threading.Thread(target=start, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for httpd in servers:
            httpd.shutdown()


def wait(url: str, ready_timeout_s: float) -> float:
    settings = RemoteSettings(url=url, model="m", timeout_s=5, ready_timeout_s=ready_timeout_s)
    client = InferenceClient(settings, url)
    started = time.monotonic()
    try:
        client.wait_ready()
    finally:
        client.close()
    return time.monotonic() - started


def test_a_job_waits_through_a_server_that_starts_then_loads_its_model_past_the_grace():
    # Down for 1 s; ready without the model for less than the grace; not ready while it
    # loads for three graces; then the model is ready.
    phases = [(0.3, 200, 503), (0.3 + 3 * GRACE_S, 503, 503), (1e9, 200, 200)]
    with serve_later(phases, delay_s=1.0) as url:
        waited = wait(url, ready_timeout_s=30)
        assert 1.0 + 3 * GRACE_S <= waited < 10


def test_a_model_the_ready_server_never_has_fails_after_the_grace_not_the_timeout():
    with serve_later([(1e9, 200, 400)], delay_s=0.5) as url:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"has no model 'm' ready.*check remote.model"):
            wait(url, ready_timeout_s=60)
        assert 0.5 + GRACE_S <= time.monotonic() - started < 10


def test_a_server_that_never_gets_ready_fails_at_the_timeout_with_its_last_answer():
    with (
        serve_later([(1e9, 503, 503)], delay_s=0.0) as url,
        pytest.raises(RemoteError, match=r"server was not ready within .*HTTP 503"),
    ):
        wait(url, ready_timeout_s=2 * GRACE_S + 0.5)
