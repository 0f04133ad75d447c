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
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidesnake.atomic import atomic_output
from slidesnake.embed.loop import ModelRun, device_name, run_models, slide_device
from slidesnake.embed.records import loop_rates, peak_memory_mb, read_counts, slide_attributes
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.startup import process_started
from slidesnake.embed.store import EmbeddingWriter, open_embeddings
from slidesnake.errors import ConfigError, EmbeddingsError, ModelError, SlideError
from slidesnake.loader.batches import TileBatches
from slidesnake.models.embedder import DTYPES, Embedder, build_embedder, parameter_count
from slidesnake.models.registry import ModelInput, ModelSpec, model_input, model_spec
from slidesnake.slides import stores
from slidesnake.tiling.grid import TileGeometry
from slidesnake.tiling.tile_table import read_tiles

log = logging.getLogger(__name__)

# What a model needs on a GPU beyond its weights: activations of a batch, the allocator's
# slack. Generous on purpose: the check is there to refuse a list that cannot fit.
ACTIVATION_BYTES = 2 * 2**30


@dataclass(frozen=True)
class ModelOutputs:
    """Where one model's outputs for one slide go."""

    zarr: Path
    metrics: Path


def embedding_keys(
    params: dict[str, dict[str, Any]], tiles_path: str | Path, slide_path: str | Path
) -> dict[str, str]:
    """What each model's embeddings of a slide depend on, as one digest per key: its
    params (as the rule has them), the tile table's bytes and the slide's size and
    modification time (in a store, its size and version)."""
    try:
        if stores.is_url(slide_path) or Path(slide_path).is_dir():
            stat = stores.stat_slide(slide_path, "")
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


def is_current(outputs: ModelOutputs, key: str) -> bool:
    """Both outputs exist, finished, and record `key`."""
    try:
        recorded = json.loads(outputs.metrics.read_text()).get("embedding_key")
        return recorded == key and open_embeddings(outputs.zarr).attrs.get("embedding_key") == key
    except (OSError, ValueError, AttributeError, EmbeddingsError):
        return False


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
    given by the caller: the remote backend builds on this room, not the reverse)."""
    started = process_started()
    keys = embedding_keys({key: params[key] for key in settings}, tiles_path, slide_path)
    stale = [key for key in settings if not is_current(outputs[key], keys[key])]
    for key in settings.keys() - set(stale):
        log.info("slide '%s': model %s is current; not embedded again", slide_id, key)
    if not stale:
        return {}
    local = [key for key in stale if settings[key].backend == "local"]
    device = (device or slide_device()) if local else torch.device("cpu")
    tiles, geometry = read_tiles(tiles_path)
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    wanted = {key: _wanted(key, settings[key], geometry) for key in stale}
    if device.type == "cuda":
        needs = {
            key: weights_bytes(wanted[key][0], settings[key]) + ACTIVATION_BYTES for key in local
        }
        check_memory(needs, *torch.cuda.mem_get_info(device), jobs_on_gpu)
    first = settings[stale[0]]
    batch_size = min(settings[key].batch_size for key in stale)  # the one that fits them all
    dataset = TileBatches(slide_path, slide_id, coords, geometry, batch_size, first.block)
    with dataset.stream(first.workers, first.prefetch) as batches, ExitStack() as job:
        models = {
            key: _open(wanted[key], settings[key], device, slide_id, open_served) for key in stale
        }
        for model in models.values():
            if not isinstance(model, Embedder):
                job.callback(model.close)
        digests = {key: model.weights_digest() for key, model in models.items() if key in local}
        log.info(
            "slide '%s': %d tiles read once for models %s on %s, batch %d",
            slide_id, len(coords), ", ".join(stale), device, batch_size,
        )  # fmt: skip
        runs = []
        for key in stale:
            store = job.enter_context(atomic_output(outputs[key].zarr))
            dtype = settings[key].output_dtype
            writer = EmbeddingWriter(store, coords, models[key].dim, dtype)
            runs.append(_run(models[key], writer, dtype))
        timings = run_models(runs, batches, dataset.batch_shape, first, device)
        timings["startup_s"] = timings.pop("first_batch_at") - started
        slide = slide_attributes(slide_path, slide_id, geometry, dataset.slide_stat)
        for key, run in zip(stale, runs, strict=True):
            attributes = _attributes(slide, key, run, settings[key])
            digest = digests.get(key)
            attributes |= {"embedding_key": keys[key], "timings": timings}
            attributes["weights_sha256"] = digest.value() if digest else None
            run.writer.finish(attributes)
    shared = {
        "models_in_job": stale,
        "job_s": round(time.perf_counter() - started, 3),
        "device": str(device),
        "device_name": device_name(device),
        "batch_size": batch_size,
    }
    metrics = {
        key: _metrics(key, run, len(coords), timings, shared) | {"embedding_key": keys[key]}
        for key, run in zip(stale, runs, strict=True)
    }
    for key, values in metrics.items():
        with atomic_output(outputs[key].metrics) as tmp:
            tmp.write_text(json.dumps(values, indent=2) + "\n")
    _log_done(slide_id, len(coords), timings, metrics, shared["job_s"])
    return metrics


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
        "model_s": round(model_s, 3),
        "model_tiles_per_s": round(tiles / model_s, 2) if model_s > 0 else 0.0,
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
