"""Several models from one read: a slide's tiles are decoded once and embedded by every
model of `models:` whose outputs are not current.

Snakemake sees one job per slide that makes every model's outputs, flagged `update` so
that a job keeps what it does not redo. The job decides model by model: a model's outputs
are current when they record the embedding key the job would give them now (the model's
params, the tile table's bytes and the slide's identity), and only the other models are
built and fed. Each batch crosses to the device once; each model cuts and resizes its own
input from it (`ModelInput`), writes its own store, and times its own kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidesnake.atomic import OutputSet, atomic_output, output_set
from slidesnake.embed.loop import ModelRun, device_name, run_models, slide_device
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.records import (
    loop_rates,
    model_time,
    peak_memory_mb,
    read_counts,
    slide_attributes,
)
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.startup import process_started
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.errors import (
    ConfigError,
    ModelError,
    ModelsFailedError,
    SlideError,
    SlidesnakeError,
)
from slidesnake.loader.batches import TileBatches
from slidesnake.models.embedder import DTYPES, Embedder, build_embedder, parameter_count
from slidesnake.models.registry import ModelInput, ModelSpec, model_input, model_spec
from slidesnake.slides.locator import SlideKind, slide_kind, stat_slide
from slidesnake.tiling.grid import TileGeometry
from slidesnake.tiling.tile_table import read_tiles

log = logging.getLogger(__name__)

# What a model needs on a GPU beyond its weights: activations of a batch, the allocator's
# slack. Generous on purpose: the check is there to refuse a list that cannot fit.
ACTIVATION_BYTES = 2 * 2**30


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


def weights_bytes(spec: ModelSpec, settings: EmbedSettings) -> int:
    """The bytes a model's weights take on its device: its parameters at its precision,
    or a program's file size."""
    if spec.architecture is None:
        return Path(settings.checkpoint).stat().st_size if settings.checkpoint else 0
    return parameter_count(spec) * DTYPES[settings.precision].itemsize


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


def embed_slide_models(
    slide_path: str | Path,
    slide_id: str,
    tiles_path: str | Path,
    outputs: dict[str, ModelOutputs],
    settings: dict[str, EmbedSettings],
    params: dict[str, dict[str, Any]],
    device: torch.device | None = None,
    jobs_on_gpu: int = 1,
    open_served: Callable[..., Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Embed the tiles of `tiles_path` with every model (by key) whose outputs are not
    current; returns the metrics of those it embedded. `jobs_on_gpu`: how many jobs may
    share this job's GPU, for the check that the models fit it. `open_served(settings,
    spec, input, slide_id)`: the run of a served model (`remote.model_run.RemoteRun`,
    given by the caller: the remote backend builds on this room, not the reverse).

    A model that fails drops out, its error logged with its key; the others finish and
    wait in their kept folders (`ModelOutputs.kept`), and ModelsFailedError ends the job.
    The outputs move into place only when every model is current."""
    started = process_started()
    keys = embedding_keys({key: params[key] for key in settings}, tiles_path, slide_path)
    waiting, stale = _models_not_in_place(outputs, keys, slide_id)
    metrics: dict[str, dict[str, Any]] = {}
    if stale:
        kept = {key: outputs[key].kept() for key in stale}
        job = _ModelJob(slide_path, slide_id, tiles_path, settings, started)
        metrics, failed = job.embed(stale, kept, keys, device, jobs_on_gpu, open_served)
        if failed:
            raise _failed(slide_id, failed, [key for key in stale if key not in failed])
    for key in [*waiting, *stale]:
        outputs[key].kept().move_to(outputs[key])
    return metrics


def _models_not_in_place(
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


def _failed(slide_id: str, failed: dict[str, Exception], done: list[str]) -> ModelsFailedError:
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


class _ModelJob:
    """The stale models of one slide, embedded from one read into their kept folders."""

    def __init__(self, slide_path, slide_id: str, tiles_path, settings, started: float) -> None:
        self.slide_path, self.slide_id, self.settings = slide_path, slide_id, settings
        self.started = started
        tiles, self.geometry = read_tiles(tiles_path)
        self.coords = tiles[["x", "y"]].to_numpy(np.int64)
        self.failed: dict[str, Exception] = {}

    def embed(self, stale, kept, keys, device, jobs_on_gpu, open_served) -> tuple[dict, dict]:
        """The metrics of the models that finished, and the errors of those that failed."""
        settings = self.settings
        local = [key for key in stale if settings[key].backend == "local"]
        device = (device or slide_device()) if local else torch.device("cpu")
        wanted = {key: _wanted(key, settings[key], self.geometry) for key in stale}
        if device.type == "cuda":
            needs = {
                key: weights_bytes(wanted[key][0], settings[key]) + ACTIVATION_BYTES
                for key in local
            }
            check_memory(needs, *torch.cuda.mem_get_info(device), jobs_on_gpu)
        first = settings[stale[0]]
        batch_size = min(settings[key].batch_size for key in stale)  # one that fits them all
        dataset = TileBatches(
            self.slide_path,
            self.slide_id,
            self.coords,
            self.geometry,
            batch_size,
            first.block,
            first.decode,
        )
        with dataset.stream(first.workers, first.prefetch) as batches, ExitStack() as job:
            models = self._open(stale, wanted, device, open_served, job)
            if not models:
                return {}, self.failed
            log.info(
                "slide '%s': %d tiles read once for models %s on %s, batch %d",
                self.slide_id, len(self.coords), ", ".join(models), device, batch_size,
            )  # fmt: skip
            with output_set([kept[key].zarr for key in models]) as stores:
                runs = self._runs(models, stores, kept)
                timings, failed = run_models(
                    list(runs.values()), batches, dataset.batch_shape, first, device
                )
                self.failed |= {list(runs)[index]: err for index, err in failed.items()}
                timings["startup_s"] = timings.pop("first_batch_at") - self.started
                slide = slide_attributes(
                    self.slide_path, self.slide_id, self.geometry, dataset.slide_stat
                )
                slide |= dataset.read_attributes
                self._finish(runs, stores, kept, keys, slide, timings)
        shared = {
            "models_in_job": stale,
            "job_s": round(time.perf_counter() - self.started, 3),
            "device": str(device),
            "device_name": device_name(device),
            "batch_size": batch_size,
        }
        done = {key: run for key, run in runs.items() if key not in self.failed}
        return self._write_metrics(done, kept, keys, timings, shared), self.failed

    def _write_metrics(self, done: dict, kept, keys, timings: dict, shared: dict) -> dict:
        """Each finished model's metrics, written beside its kept store."""
        metrics = {
            key: _metrics(key, run, len(self.coords), timings, shared)
            | {"embedding_key": keys[key]}
            for key, run in done.items()
        }
        for key, values in metrics.items():
            with atomic_output(kept[key].metrics) as tmp:
                tmp.write_text(json.dumps(values, indent=2) + "\n")
        if metrics:
            _log_done(self.slide_id, len(self.coords), timings, metrics, shared["job_s"])
        return metrics

    def _open(self, stale, wanted, device, open_served, job: ExitStack) -> dict:
        """Each model ready to embed, by key; one that cannot be opened (its weights, its
        server) fails alone."""
        models = {}
        for key in stale:
            try:
                models[key] = _open(
                    wanted[key], self.settings[key], device, self.slide_id, open_served
                )
            except Exception as err:
                self.failed[key] = err
                continue
            if not isinstance(models[key], Embedder):
                job.callback(models[key].close)
        return models

    def _runs(self, models: dict, stores: OutputSet, kept: dict[str, ModelOutputs]) -> dict:
        runs = {}
        for key, model in models.items():
            dtype = self.settings[key].output_dtype
            store = stores.path(kept[key].zarr)
            runs[key] = _run(model, EmbeddingWriter(store, self.coords, model.dim, dtype), dtype)
        # Threads, so after the loader's fork: the digests of the local models' weights.
        local = {key: model for key, model in models.items() if isinstance(model, Embedder)}
        self.digests = {key: model.weights_digest() for key, model in local.items()}
        return runs

    def _finish(self, runs, stores: OutputSet, kept, keys, slide: dict, timings: dict) -> None:
        """Record each finished store's attributes; drop the stores of failed models."""
        for key, run in runs.items():
            if key not in self.failed:
                digest = self.digests.get(key)
                attributes = _attributes(slide, key, run, self.settings[key])
                attributes |= {"embedding_key": keys[key], "timings": timings}
                attributes["weights_sha256"] = digest.value() if digest else None
                try:
                    run.writer.finish(attributes)
                except Exception as err:
                    self.failed[key] = err
            if key in self.failed:
                stores.drop(kept[key].zarr)
                kept[key].remove()


def _open(wanted: tuple, settings: EmbedSettings, device, slide_id: str, open_served):
    """One model ready to embed: an Embedder on `device`, or a served model's run,
    connected (its server ready, its model there, its width known)."""
    if settings.backend == "local":
        return _embedder(*wanted, settings, device)
    if open_served is None:
        raise ConfigError(f"model '{settings.model}' is served, and this caller serves none")
    run = open_served(settings, *wanted, slide_id)
    run.connect()
    return run


def _run(model, writer: EmbeddingWriter, dtype: str):
    """The part of the loop of an opened model, writing into `writer`."""
    if isinstance(model, Embedder):
        return ModelRun(model, writer, dtype, timed=True)
    model.writer = writer
    return model


def _wanted(key: str, settings: EmbedSettings, geometry: TileGeometry) -> tuple:
    """(spec, input) of one model for these tiles."""
    spec = model_spec(settings.model, settings.mean, settings.std)
    label = f"models.{key}"
    size, mpp = settings.input_size, settings.input_mpp
    return spec, model_input(spec, geometry.size, geometry.target_mpp, size, mpp, label)


def _embedder(
    spec: ModelSpec, wanted: ModelInput, settings: EmbedSettings, device: torch.device
) -> Embedder:
    embedder = build_embedder(
        spec, settings.weights, settings.checkpoint, wanted.size, device, settings.precision
    )
    embedder.crop = wanted.crop
    return embedder


def _attributes(slide: dict, key: str, run, settings) -> dict:
    """One model's zarr attributes: the slide's (`slide_attributes`) and its own."""
    if not isinstance(run, ModelRun):
        return {**slide, "model_key": key, **run.attributes()}
    embedder = run.embedder
    return {
        **slide,
        "backend": "local",
        "model_key": key,
        "model": embedder.spec.name,
        "model_output": embedder.spec.output,
        "embedding_dim": embedder.dim,
        "model_input_px": embedder.input_size,
        "model_input_crop": embedder.crop,
        "weights": settings.weights,
        "precision": str(embedder.dtype).removeprefix("torch."),
        "features_dtype": settings.output_dtype,
    }


def _metrics(key: str, run, tiles: int, timings, job: dict) -> dict:
    """One model's metrics: its own time and tiles/s, and the job's (the read, the loop's
    wait for data, the start-up), which every model of the job shares."""
    model_s = run.model_s()
    if isinstance(run, ModelRun):
        own = {
            **{name: round(seconds, 3) for name, seconds in run.embedder.load_s.items()},
            "precision": str(run.embedder.dtype).removeprefix("torch."),
            "model": run.embedder.spec.name,
            "backend": "local",
        }
    else:
        own = {"model": run.spec.name, "backend": "remote", **run.metrics()}
    return {
        **loop_rates(tiles, timings),
        **model_time(model_s, tiles, job["job_s"]),
        "startup_s": round(timings["startup_s"], 3),
        **read_counts(timings),
        **job,
        "model_key": key,
        **own,
        **peak_memory_mb(),
    }


def _log_done(slide_id: str, tiles: int, timings, metrics: dict[str, dict], job_s: float) -> None:
    each = ", ".join(f"{key} {m['model_s']:.1f} s" for key, m in metrics.items())
    log.info(
        "slide '%s': %d tiles in %.1f s (%.1f tiles/s), %d compressed tiles decoded once for "
        "%d models (model time: %s), loader wait %.0f%%; whole job %.1f s",
        slide_id, tiles, timings["wall_s"], tiles / max(timings["wall_s"], 1e-9),
        timings["compressed_tiles_decoded"], len(metrics), each,
        100 * timings["loader_wait_s"] / max(timings["wall_s"], 1e-9), job_s,
    )  # fmt: skip
