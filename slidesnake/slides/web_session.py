"""A `requests` session whose every answer is bounded in time and size, for the DICOMweb
servers that wsidicom (through dicomweb-client) and the series' identity check talk to.

Those libraries read each answer whole (`response.content`, `response.json()`), so a
server that sends without end fills memory and one that drips a byte a second holds the
job for ever. Here each request gets the run's connect and read deadlines, and the body
is read before anyone sees it: at most `storage.max_answer_mb`, within
`storage.request_timeout_s`.
"""

from __future__ import annotations

import time
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from slidesnake.slides.range_requests import Deadlines, Oversized, Unanswered

CHUNK = 1 << 16


class BoundedAdapter(HTTPAdapter):
    """An HTTP adapter that reads each answer's body itself, within bounds. Once a server
    has let one question go unanswered, the next ones fail at once: a library that asks
    again, or asks the next frame, must not multiply the deadline."""

    def __init__(self, deadlines: Deadlines, max_bytes: int) -> None:
        super().__init__()
        self.deadlines, self.max_bytes = deadlines, max_bytes
        self.unanswered: Exception | None = None

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        if self.unanswered is not None:
            raise Unanswered(f"the server did not answer before ({self.unanswered})")
        try:
            return self._send(request, **kwargs)
        except (Unanswered, requests.Timeout) as err:
            self.unanswered = err
            raise

    def _send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        started = time.monotonic()
        kwargs["timeout"] = (self.deadlines.connect_s, self.deadlines.read_s)
        kwargs["stream"] = True
        response = super().send(request, **kwargs)
        try:
            # requests keeps a body it has read in `_content`; reading it here, bounded,
            # is what every later `.content`, `.json()` or `.iter_content()` then sees.
            response._content = self._body(response, started + self.deadlines.request_s)
            response._content_consumed = True
            response.raw.release_conn()
        except BaseException:
            response.close()
            raise
        return response

    def _body(self, response: requests.Response, deadline: float) -> bytes:
        body = bytearray()
        while chunk := response.raw.read1(CHUNK, decode_content=True):
            body += chunk
            if len(body) > self.max_bytes:
                raise Oversized(f"an answer longer than {self.max_bytes >> 20} MB")
            if time.monotonic() > deadline:
                raise Unanswered(f"no whole answer within {self.deadlines.request_s:g} s")
        return bytes(body)


def bounded_session(deadlines: Deadlines, max_bytes: int) -> requests.Session:
    """A session whose answers are bounded by `deadlines` and `max_bytes`."""
    session = requests.Session()
    adapter = BoundedAdapter(deadlines, max_bytes)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
