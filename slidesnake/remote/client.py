"""An HTTP client of one model on an inference server: readiness, metadata, inference.

Requests that may succeed on a second try (connection errors, timeouts, 429, 5xx) are
retried with exponential backoff and jitter, so that many slide jobs that lost the
server together do not come back in step; a `Retry-After` the server sends wins. Refusals
that no retry changes (401/403, 404, 413, other 4xx) fail at once with what to change.
The bearer token is read from the environment and lives only in the client's headers.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from slidesnake.embed.settings import RemoteSettings
from slidesnake.errors import ConfigError, RemoteError, RemoteRefusedError
from slidesnake.remote.protocol import (
    HEADER_LENGTH,
    ModelMetadata,
    decode_response,
    encode_request,
    parse_metadata,
)

log = logging.getLogger(__name__)

BACKOFF_S = 0.5  # the first retry waits 0.25-0.5 s; each next one twice as long
MAX_BACKOFF_S = 30.0
MODEL_GRACE_S = 30.0  # a server that has just started may still be loading its models
_RETRIED_STATUS = {429, 500, 502, 503, 504}


class InferenceClient:
    """One server, one model; safe to share between the threads that send requests."""

    def __init__(self, settings: RemoteSettings, url: str) -> None:
        self.settings = settings
        self.url = redact(url)
        headers = {}
        if (token := read_token(settings.token_env)) is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=settings.timeout_s,
            verify=settings.verify_tls,
            limits=httpx.Limits(max_connections=settings.max_concurrency),
        )
        self._lock = threading.Lock()
        self.latencies_s: list[float] = []
        self.retries = 0

    def close(self) -> None:
        self._http.close()

    def wait_ready(self) -> None:
        """Wait until the server and then the model say they are ready: a job may start
        while its server is still loading weights. A refused token fails at once, a
        model the server still does not know after a grace period fails as a config error."""
        deadline = time.monotonic() + self.settings.ready_timeout_s
        self._poll("/v2/health/ready", deadline, "the server")
        grace = min(deadline, time.monotonic() + MODEL_GRACE_S)
        if not self._poll(f"/v2/models/{self.settings.model}/ready", grace, None):
            raise ConfigError(
                f"inference server {self.url} has no model '{self.settings.model}' ready"
                f"{self._served_models()}; check remote.model"
            )

    def _poll(self, path: str, deadline: float, what: str | None) -> bool:
        """GET `path` until it answers 200 or `deadline`; then False, or an error naming
        `what` was not ready when `what` is given."""
        last = "no answer yet"
        while True:
            try:
                response = self._http.get(path)
            except httpx.TimeoutException:
                raise RemoteError(
                    f"inference server {self.url} did not answer within remote.timeout_s "
                    f"({self.settings.timeout_s} s); check that it is up and that remote.url "
                    "points at it"
                ) from None
            except httpx.TransportError as err:
                last = _describe(err)
            else:
                if response.status_code == 200:
                    return True
                self._refuse_on_auth(response)
                last = f"HTTP {response.status_code} (not ready)"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        if what is None:
            return False
        raise RemoteError(
            f"inference server {self.url}: {what} was not ready within "
            f"remote.ready_timeout_s ({self.settings.ready_timeout_s} s), the last answer: "
            f"{last}; start it, or check remote.url"
        )

    def metadata(self) -> ModelMetadata:
        """The model's inputs and outputs; ConfigError if the server does not have it."""
        response = self._send("GET", f"/v2/models/{self.settings.model}")
        return parse_metadata(response.json())

    def infer(self, input_name: str, datatype: str, array: np.ndarray, output: str) -> np.ndarray:
        """One batch through the model; its latency (retries included) is recorded."""
        body, headers = encode_request(input_name, datatype, array, output)
        started = time.perf_counter()
        response = self._send(
            "POST", f"/v2/models/{self.settings.model}/infer", content=body, headers=headers
        )
        features = decode_response(response.content, response.headers.get(HEADER_LENGTH), output)
        with self._lock:
            self.latencies_s.append(time.perf_counter() - started)
        return features

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        last = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                last = _describe(err)
                self._pause(attempt, None, last)
                continue
            if response.status_code < 300:
                return response
            self._refuse(response)
            last = f"HTTP {response.status_code}: {_text(response)}"
            self._pause(attempt, response.headers.get("Retry-After"), last)
        raise self._down(last)

    def _pause(self, attempt: int, retry_after: str | None, reason: str) -> None:
        if attempt == self.settings.retries:
            return
        wait = _retry_after_s(retry_after)
        if wait is None:  # half fixed, half random: jobs spread out, yet the window is known
            ceiling = min(MAX_BACKOFF_S, BACKOFF_S * 2**attempt)
            wait = random.uniform(ceiling / 2, ceiling)
        log.warning("%s: %s; retry %d of %d in %.1f s", self.url, reason, attempt + 1,
                    self.settings.retries, wait)  # fmt: skip
        time.sleep(wait)

    def _refuse(self, response: httpx.Response) -> None:
        """Raise for an answer no retry changes; return for one worth retrying."""
        self._refuse_on_auth(response)
        status = response.status_code
        if status in _RETRIED_STATUS or "unknown model" in response.text:
            return  # Triton answers 400 "unknown model" while a restarted server loads it
        if status == 404:
            raise ConfigError(
                f"inference server {self.url} has no model '{self.settings.model}' "
                f"({_text(response)}){self._served_models()}; check remote.model"
            )
        if status == 413:
            raise RemoteError(
                f"inference server {self.url} refused a request of {self.settings.batch_size} "
                "tiles as too large (HTTP 413); lower remote.batch_size"
            )
        raise RemoteError(
            f"inference server {self.url} refused a request (HTTP {status}: {_text(response)})"
        )

    def _refuse_on_auth(self, response: httpx.Response) -> None:
        if response.status_code in (401, 403):
            held = f"the token in ${self.settings.token_env}" if self.settings.token_env else (
                "a request without a token (set remote.token_env)")  # fmt: skip
            raise RemoteRefusedError(
                f"inference server {self.url} refused {held} (HTTP {response.status_code}); "
                "check the token"
            )

    def _served_models(self) -> str:
        """'; it serves: a, b' from Triton's repository index, where the server has one."""
        try:
            response = self._http.post("/v2/repository/index", json={"ready": True})
            names = sorted({entry["name"] for entry in response.json()})
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return ""
        return f"; it serves: {', '.join(names)}" if names else ""

    def _down(self, last: str) -> RemoteError:
        return RemoteError(
            f"inference server {self.url} failed after {self.settings.retries + 1} attempts, "
            f"the last: {last}; check that the server is up, or raise remote.retries"
        )


def read_token(variable: str | None) -> str | None:
    """The bearer token from the environment variable named by remote.token_env."""
    if variable is None:
        return None
    token = os.environ.get(variable, "").strip()
    if not token:
        raise ConfigError(
            f"remote.token_env names ${variable}, which is not set in the job's environment; "
            "export it where the jobs run"
        )
    return token


def redact(url: str) -> str:
    """`url` without user and password, for messages and metrics."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _retry_after_s(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return min(max(float(value), 0.0), MAX_BACKOFF_S * 4)
    except ValueError:
        return None  # an HTTP date: rare from inference servers; back off as usual


def _describe(err: httpx.TransportError) -> str:
    if isinstance(err, httpx.TimeoutException):
        return f"no answer within the timeout ({type(err).__name__})"
    return f"{type(err).__name__}: {err}"


def _text(response: httpx.Response) -> str:
    return " ".join(response.text.split())[:200]
