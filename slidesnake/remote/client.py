"""An HTTP client of one model on an inference server: readiness, metadata, inference.

Requests that may succeed on a second try (connection errors, timeouts, 429, 5xx) are
retried with exponential backoff and jitter, so that many slide jobs that lost the
server together do not come back in step; a `Retry-After` the server sends wins. Refusals
that no retry changes (401/403, 404, 413, other 4xx) fail at once with what to change.
The bearer token is read from the environment and lives only in the client's headers;
it, and a password in the URL, are redacted from every line the job writes. An answer is
read against a deadline (remote.timeout_s for the whole answer, not per read: a server
that drips a byte at a time cannot hold a job) and a size bound made from the batch and
the width, and checked against the output's declared shape and datatype.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from slidesnake.embed.settings import RemoteSettings
from slidesnake.errors import (
    ConfigError,
    RemoteError,
    RemoteProtocolError,
    RemoteRefusedError,
    one_line,
)
from slidesnake.remote.protocol import (
    DATATYPES,
    HEADER_LENGTH,
    ModelMetadata,
    TensorMetadata,
    decode_response,
    encode_request,
    parse_metadata,
)
from slidesnake.remote.redaction import protect, protect_userinfo, redact_text

log = logging.getLogger(__name__)
# httpx logs every request's URL at INFO, credentials included: only its warnings pass.
logging.getLogger("httpx").setLevel(logging.WARNING)

BACKOFF_S = 0.5  # the first retry waits 0.25-0.5 s; each next one twice as long
MAX_BACKOFF_S = 30.0
MODEL_GRACE_S = 30.0  # a server that has just started may still be loading its models
_RETRIED_STATUS = {429, 500, 502, 503, 504}
# The most an answer may hold: its JSON header, and a value per tile and dimension at
# most this many bytes (24: a float written as JSON text; binary takes 2-8).
HEADER_BYTES = 1 << 16
VALUE_BYTES = 24
PROBE_WIDTH = 1 << 16  # the widest answer accepted while the width is still unknown


class AnswerTooSlow(httpx.TimeoutException):
    """The whole answer did not arrive within remote.timeout_s."""


@dataclass(frozen=True)
class Answer:
    """A server's whole answer, read within its deadline and size bound."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class InferenceClient:
    """One server, one model; safe to share between the threads that send requests."""

    def __init__(self, settings: RemoteSettings, url: str) -> None:
        self.settings = settings
        self.url = redact(url)
        headers = {}
        if (token := read_token(settings.token_env)) is not None:
            headers["Authorization"] = f"Bearer {token}"
            protect(token)
        parts = urlsplit(url)
        protect_userinfo(parts.username, parts.password)
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
        self._last_answer = "no answer yet"

    def close(self) -> None:
        self._http.close()

    def wait_ready(self, wait_s: float | None = None, whose: str = "") -> None:
        """Wait until the model says it is ready: a job may start while its server is
        still starting, loading weights or being restarted. Triton answers 'not ready'
        alike for a model it is loading and one it does not have, and its own readiness
        drops while it loads; so a model is taken as missing (a config error) only once
        the server has said it is ready for MODEL_GRACE_S on end. A refused token fails
        at once. `wait_s`, `whose`: a shorter wait than remote.ready_timeout_s, and whose
        it is (doctor's), for the line that says how long it waited."""
        wait_s = self.settings.ready_timeout_s if wait_s is None else wait_s
        waited = f"remote.ready_timeout_s ({self.settings.ready_timeout_s:g} s)"
        if whose:
            waited = f"{whose} of {wait_s:g} s (jobs wait {waited})"
        deadline = time.monotonic() + wait_s
        server_ready_since: float | None = None
        while True:
            if self._answers_ready(f"/v2/models/{self.settings.model}/ready"):
                return
            now = time.monotonic()
            if self._answers_ready("/v2/health/ready"):
                server_ready_since = server_ready_since or now
            else:
                server_ready_since = None
            if server_ready_since is not None and (
                now - server_ready_since >= MODEL_GRACE_S or now >= deadline
            ):
                raise ConfigError(
                    f"inference server {self.url} has no model '{self.settings.model}' ready"
                    f"{self._served_models()}; check remote.model"
                )
            if now >= deadline:
                raise RemoteError(
                    f"inference server {self.url}: the server was not ready within "
                    f"{waited}, the last answer: {self._last_answer}; start it, or check "
                    "remote.url"
                )
            time.sleep(min(1.0, max(deadline - now, 0.0)))

    def _answers_ready(self, path: str) -> bool:
        """Whether GET `path` answers 200; what it answered otherwise is kept for the
        error a job fails with once it stops waiting."""
        try:
            response = self._http.get(path)
        except httpx.TimeoutException:
            raise RemoteError(
                f"inference server {self.url} did not answer within remote.timeout_s "
                f"({self.settings.timeout_s} s); check that it is up and that remote.url "
                "points at it"
            ) from None
        except httpx.TransportError as err:
            self._last_answer = _describe(err)
            return False
        if response.status_code == 200:
            return True
        self._refuse_on_auth(response)
        self._last_answer = f"HTTP {response.status_code} (not ready)"
        return False

    def metadata(self) -> ModelMetadata:
        """The model's inputs and outputs; ConfigError if the server does not have it."""
        answer = self._send("GET", f"/v2/models/{self.settings.model}", HEADER_BYTES)
        try:
            return parse_metadata(answer.json())
        except (ValueError, RecursionError) as err:
            raise RemoteProtocolError(f"malformed model metadata ({one_line(err)})") from None

    def infer(
        self,
        input_name: str,
        datatype: str,
        array: np.ndarray,
        output: TensorMetadata,
        width: int | None,
    ) -> np.ndarray:
        """One batch through the model, its answer checked against `output`'s datatype and
        (len(array), width); its latency (retries included) is recorded."""
        body, headers = encode_request(input_name, datatype, array, output.name)
        started = time.perf_counter()
        batch = len(array)
        limit = HEADER_BYTES + batch * (width or PROBE_WIDTH) * VALUE_BYTES
        answer = self._send(
            "POST", f"/v2/models/{self.settings.model}/infer", limit, content=body,
            headers=headers,
        )  # fmt: skip
        features = decode_response(answer.content, answer.headers.get(HEADER_LENGTH), output.name)
        self._check_answer(features, output, batch, width)
        with self._lock:
            self.latencies_s.append(time.perf_counter() - started)
        return features

    def _check_answer(
        self, features: np.ndarray, output: TensorMetadata, batch: int, width: int | None
    ) -> None:
        expected = f"({batch}, {width if width else 'D'})"
        if features.dtype != DATATYPES[output.datatype]:
            found = next((k for k, v in DATATYPES.items() if v == features.dtype), features.dtype)
            problem = f"{found} features where its metadata declares {output.datatype}"
        elif features.ndim != 2 or len(features) != batch or (width and features.shape[1] != width):
            problem = f"features of shape {features.shape} for {expected}"
        else:
            return
        raise RemoteProtocolError(
            f"inference server {self.url}, model '{self.settings.model}' answered {problem}; "
            "fix the served model (or its config) so that it gives what it declares"
        )

    def _send(self, method: str, path: str, max_bytes: int, **kwargs) -> Answer:
        last = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
            try:
                answer = self._exchange(method, path, max_bytes, **kwargs)
            except httpx.TransportError as err:
                last = _describe(err)
                self._pause(attempt, None, last)
                continue
            if answer.status_code < 300:
                return answer
            self._refuse(answer)
            last = f"HTTP {answer.status_code}: {_text(answer)}"
            self._pause(attempt, answer.headers.get("Retry-After"), last)
        raise self._down(last)

    def _exchange(self, method: str, path: str, max_bytes: int, **kwargs) -> Answer:
        """The whole answer within remote.timeout_s and `max_bytes`."""
        deadline = time.monotonic() + self.settings.timeout_s
        with self._http.stream(method, path, **kwargs) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise self._too_large(int(declared), max_bytes)
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise self._too_large(size, max_bytes)
                if time.monotonic() > deadline:
                    limit = self.settings.timeout_s
                    raise AnswerTooSlow(f"the answer took longer than remote.timeout_s ({limit} s)")
                chunks.append(chunk)
        return Answer(response.status_code, response.headers, b"".join(chunks))

    def _too_large(self, size: int, max_bytes: int) -> RemoteProtocolError:
        return RemoteProtocolError(
            f"inference server {self.url} answered {size:,} bytes or more, more than the "
            f"{max_bytes:,} its batch and width can need; fix the served model"
        )

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

    def _refuse(self, response: Answer) -> None:
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

    def _refuse_on_auth(self, response: Answer | httpx.Response) -> None:
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
    if isinstance(err, AnswerTooSlow):
        return str(err)
    if isinstance(err, httpx.TimeoutException):
        return f"no answer within the timeout ({type(err).__name__})"
    return redact_text(f"{type(err).__name__}: {one_line(err)}")


def _text(response: Answer | httpx.Response) -> str:
    """A server's body for a line of the log: short, printable, without our secrets."""
    return redact_text(one_line(response.text))
