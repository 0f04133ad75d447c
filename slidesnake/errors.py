"""Exceptions raised by slidesnake.

Every error about a slide names the slide, what is wrong and what to do, so that a failed
job in a cohort of thousands is understood from its one-line message.
"""

from __future__ import annotations

from pathlib import Path


def one_line(value: object, limit: int = 200) -> str:
    """Text from elsewhere (a library's message, a server's body) made fit for an error
    line: one line of printable characters, at most `limit` of them."""
    text = " ".join(str(value)[: 4 * limit].split())
    text = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "…"


class SlidesnakeError(Exception):
    """Base class of all errors slidesnake raises on purpose."""


class SlideError(SlidesnakeError):
    """A problem with one slide: it fails that slide's job and no other."""

    def __init__(self, slide_id: str, path: str | Path, problem: str, fix: str) -> None:
        self.slide_id = slide_id
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"slide '{slide_id}' ({self.path}): {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        # Raised in loader workers and re-raised in the main process: pickled on the way.
        return type(self), (self.slide_id, self.path, self.problem, self.fix)


class SlideOpenError(SlideError):
    """The file is missing, not a slide, or in a format OpenSlide does not support."""


class SlideReadError(SlideError):
    """The slide opened but its pixels could not be decoded."""


class StoreTimeoutError(SlideReadError):
    """The store holding the slide did not answer within storage.*_timeout_s."""


class SlideSizeError(SlideError):
    """Reading the slide would decode more pixels than the configured bound allows."""


class MppError(SlideError):
    """The slide's microns per pixel are unknown or implausible."""


class LoaderWorkerError(SlidesnakeError):
    """A tile loader worker process failed on something other than the slide, or died."""


class SampleSheetError(SlidesnakeError):
    """The sample sheet is malformed: bad ids, duplicates, missing files."""


class ConfigError(SlidesnakeError):
    """The configuration is inconsistent in a way a schema cannot express."""


class ModelError(SlidesnakeError):
    """A checkpoint that cannot be read, or that does not fit its architecture."""


class EmbeddingsError(SlidesnakeError):
    """An embeddings store that is missing, unfinished or not one slidesnake wrote."""


class GpuSlotError(SlidesnakeError):
    """No GPU came free for an embedding job."""


class ClusterQueryError(SlidesnakeError):
    """The cluster's own tools (squeue, scontrol, scancel) did not answer as expected."""


class RemoteError(SlidesnakeError):
    """The inference server of the remote backend refused or failed a request."""


class RemoteProtocolError(RemoteError):
    """The server's answer is not the Open Inference Protocol slidesnake speaks."""


class RemoteRefusedError(RemoteError):
    """The server refused the token (401/403): retrying cannot help."""


class WeightsError(SlidesnakeError):
    """`slidesnake weights` could not fetch, or found no manifest to verify."""


class ModelsFailedError(SlidesnakeError):
    """Models of a model list failed; the others' outputs are kept for the next run."""


class NonFiniteError(SlidesnakeError):
    """A model, head or encoder gave NaN or infinite values: never written as a result."""
