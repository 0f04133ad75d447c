"""The remote backend's secrets (a bearer token, a password in remote.url) kept out of
every line a job writes, whatever a server sends back.

A server may echo a request's Authorization header in an error body, and HTTP clients log
request URLs; a line that reaches the job's log also reaches the terminal, cohort.tsv and
cohort.html. So every secret the client holds is registered here, and a filter on each
log handler replaces it before the line is written.
"""

from __future__ import annotations

import base64
import logging

MASK = "***"
_SECRETS: set[str] = set()


def protect(*secrets: str | None) -> None:
    """Keep `secrets` out of every line the job's log handlers write from now on."""
    _SECRETS.update(secret for secret in secrets if secret and len(secret) >= 3)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RedactingFilter) for f in handler.filters):
            handler.addFilter(_RedactingFilter())


def protect_userinfo(user: str | None, password: str | None) -> None:
    """A URL's password, and the Basic credentials an HTTP client makes of it."""
    if password:
        basic = base64.b64encode(f"{user or ''}:{password}".encode()).decode()
        protect(password, basic)


def redact_text(text: str) -> str:
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True
