"""What a store's failure means for a slide: retry it, or fail the slide with one line.

Libraries word their errors with the URL they fetched, which may hold credentials (a
user:password, a presigned signature), so an error line says what happened in our words,
the HTTP status, and the slide's location as `stores.location` shows it, nothing more.
"""

from __future__ import annotations

from slidesnake.errors import SlideError, SlideOpenError, SlideReadError, StoreTimeoutError

FIX_ACCESS = (
    "give this machine read access the store's usual way (environment variables, a "
    "profile, an instance role), or for a public bucket set storage.<scheme>.anon: true"
)
FIX_TRANSIENT = "check the network and the store's status; the next run retries the slide"


def status_of(err: BaseException) -> int | None:
    """The HTTP status behind `err`, where the library kept it."""
    status = getattr(err, "status", None)  # aiohttp's ClientResponseError
    if status is None:
        response = getattr(err, "response", None)  # botocore's ClientError
        status = (response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def is_transient(err: BaseException) -> bool:
    """Whether trying again may help: a dropped or refused connection, a timeout, a 429
    or a 5xx. Not a missing object, a refusal, or a bad request."""
    if isinstance(err, FileNotFoundError | PermissionError | SlideError):
        return False
    status = status_of(err)
    if status is not None:
        return status == 429 or status >= 500
    import aiohttp  # here, on a failure: jobs that read local slides never pay the import

    dropped = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
    return isinstance(err, (ConnectionError, TimeoutError, *dropped)) or type(err) is OSError


def describe(err: BaseException) -> str:
    """`err` in words that cannot hold a credential: its kind and HTTP status."""
    status = status_of(err)
    kind = type(err).__name__
    return f"{kind}, HTTP {status}" if status is not None else kind


FIX_SILENT = (
    "check that the store is up and reachable from where the jobs run; raise "
    "storage.connect_timeout_s, read_timeout_s or request_timeout_s for a slow one"
)


def open_error(err: BaseException, slide_id: str, where: str) -> SlideError:
    """The slide's error for a store that would not say what the object is."""
    if isinstance(err, SlideError):
        return err
    if _silent(err):
        return silent_error(err, slide_id, where)
    status = status_of(err)
    if isinstance(err, FileNotFoundError) or status == 404:
        return SlideOpenError(
            slide_id, where, "the store has no such object", "correct the URL in the sample sheet"
        )
    if isinstance(err, PermissionError) or status in (401, 403):
        return SlideOpenError(
            slide_id, where, f"the store refused access ({describe(err)})", FIX_ACCESS
        )
    return SlideOpenError(
        slide_id, where, f"the store did not answer ({describe(err)})", FIX_TRANSIENT
    )


def silent_error(err: BaseException, slide_id: str, where: str, tries: int = 1) -> SlideError:
    """The slide's error for a store that did not answer within the deadlines."""
    times = f", {tries} times" if tries > 1 else ""
    return StoreTimeoutError(
        slide_id,
        where,
        "the store did not answer within its deadlines (storage.connect_timeout_s, "
        f"read_timeout_s, request_timeout_s{times}: {describe(err)})",
        FIX_SILENT,
    )


def _silent(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) and status_of(err) is None


def read_error(err: BaseException, slide_id: str, where: str, tries: int) -> SlideError:
    """The slide's error for byte ranges the store would not give."""
    if _silent(err):
        return silent_error(err, slide_id, where, tries)
    if not is_transient(err):
        return open_error(err, slide_id, where)
    return SlideReadError(
        slide_id,
        where,
        f"reading its byte ranges failed {tries} times ({describe(err)})",
        FIX_TRANSIENT,
    )
