"""The models of `models:`, one job per slide for all of them: which to embed, whether
they fit the GPU together, and how a failed one is reported.

Snakemake sees one job per slide that makes every model's outputs, flagged `update` so
that a job keeps what it does not redo. The job decides model by model: a model's outputs
are current when they record the embedding key the job would give them now (the model's
params, the tile table's bytes and the slide's identity), and only the other models are
built and fed. No torch here: a list of served models imports none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.errors import ModelError, ModelsFailedError, SlideError, SlidesnakeError
from slidesnake.slides.locator import SlideKind, slide_kind, stat_slide

log = logging.getLogger(__name__)


def embedding_keys(
    params: dict[str, dict[str, Any]], tiles_path: str | Path, slide_path: str | Path
) -> dict[str, str]:
    """What each model's embeddings of a slide depend on, as one digest per key: its
    params (as the rule has them), the tile table's bytes and the slide's size and
    modification time (in a store, its size and version)."""
    try:
        if slide_kind(slide_path) is not SlideKind.FILE:
            stat = stat_slide(slide_path, "")
            slide = [stat.size, stat.version]
        else:
            status = os.stat(slide_path)
            slide = [status.st_size, status.st_mtime_ns]
    except (OSError, SlideError):
        slide = "missing"  # the read then fails the job with the slide's own error
    tiles = hashlib.sha256(Path(tiles_path).read_bytes()).hexdigest()

    def digest(model: dict[str, Any]) -> str:
        identity = {"params": model, "tiles_sha256": tiles, "slide": slide}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    return {key: digest(model) for key, model in params.items()}


def models_not_in_place(
    outputs: dict[str, ModelOutputs], keys: dict[str, str], slide_id: str
) -> tuple[list[str], list[str]]:
    """The models current in their kept folder only (waiting to move into place), and
    those current nowhere (to embed)."""
    waiting, stale = [], []
    for key in keys:
        final, kept = outputs[key], outputs[key].kept()
        if final.is_current(keys[key]):
            log.info("slide '%s': model %s is current; not embedded again", slide_id, key)
            kept.remove()
        elif kept.is_current(keys[key]):
            log.info("slide '%s': model %s was embedded by the last run; kept", slide_id, key)
            waiting.append(key)
        else:
            stale.append(key)
    return waiting, stale


def check_memory(needs: dict[str, int], free: int, total: int, jobs_on_gpu: int = 1) -> None:
    """ModelError, naming the models to split into runs of their own, when the models'
    needs (bytes by key) exceed this job's part of the GPU: what is free, and no more
    than its share when `jobs_on_gpu` jobs take turns on it (gpu.jobs_per_gpu)."""
    share = total // jobs_on_gpu
    budget = min(free, share)
    if sum(needs.values()) <= budget:
        return
    groups: list[list[str]] = []
    room: list[int] = []
    for key, need in sorted(needs.items(), key=lambda item: -item[1]):
        fits = next((i for i, left in enumerate(room) if need <= left), None)
        if fits is None:
            groups.append([key])
            room.append(share - need)
        else:
            groups[fits].append(key)
            room[fits] -= need
    each = ", ".join(f"{key} {need / 2**30:.1f} GiB" for key, need in needs.items())
    split = " | ".join(", ".join(group) for group in groups)
    shared = f", 1/{jobs_on_gpu} of it per job (gpu.jobs_per_gpu)" if jobs_on_gpu > 1 else ""
    raise ModelError(
        f"the models need about {sum(needs.values()) / 2**30:.1f} GiB of GPU memory ({each}) "
        f"and this job has {budget / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free{shared}); "
        f"split models: into runs of {split}"
        + (" or lower gpu.jobs_per_gpu" if jobs_on_gpu > 1 else "")
    )


def models_failed(
    slide_id: str, failed: dict[str, Exception], done: list[str]
) -> ModelsFailedError:
    """Log each failed model's line, naming its key (the cohort summary reads them);
    the job's error, naming them all."""
    for key, err in failed.items():
        if not isinstance(err, SlidesnakeError):
            log.info("model '%s', the traceback of the error below:\n%s", key,
                     "".join(traceback.format_exception(err)).rstrip())  # fmt: skip
            err = f"unexpected {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log.error("slide '%s': model '%s' failed: %s", slide_id, key, err)
    kept = f"; the embeddings of {', '.join(done)} are kept, and the next run embeds only "
    kept = kept + "the failed models" if done else ""
    return ModelsFailedError(
        f"{len(failed)} model(s) failed: {', '.join(failed)} (each one's line is above){kept}"
    )
