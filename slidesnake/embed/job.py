"""One embedding job: a slide's tiles read once, for every model of the job.

A job embeds a list of models; the run's one `model:` is a list of one. Each model is a
run (`loop.ModelRun`): a local one (`local_run`, imported only when the job has one, so
a job of served models imports no torch) or a served one, which the caller opens with
`open_served` (`remote.served_run.ServedRun`: the remote room builds on this one, not the
reverse). Served models are opened before the loader's workers fork, so a server that is
not there fails the job before a tile is read; local ones after, so that the model loads
while the workers decode: a job's fixed cost is the longer of the two, not their sum.

With the models of `models:` (`params` given) the job decides model by model which to
embed (`model_list`); they write into their kept folders and move into place once every
one is current, and a model that fails drops out alone. The run's one model, which
Snakemake asked for, writes straight to its outputs, and its error is the job's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from slidesnake.atomic import OutputSet, atomic_output, output_set
from slidesnake.embed.loop import ModelRun, run_models
from slidesnake.embed.model_list import embedding_keys, models_failed, models_not_in_place
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
from slidesnake.errors import ConfigError
from slidesnake.loader.batches import TileBatches
from slidesnake.models.registry import ModelInput, ModelSpec, model_input, model_spec
from slidesnake.tiling.tile_table import read_tiles

log = logging.getLogger(__name__)

# The key of the run's one `model:`, a list of one.
ONE_MODEL = "model"


def embed_slide(
    slide_path: str | Path,
    slide_id: str,
    tiles_path: str | Path,
    outputs: dict[str, ModelOutputs],
    settings: dict[str, EmbedSettings],
    params: dict[str, dict[str, Any]] | None = None,
    device: Any = None,
    jobs_on_gpu: int = 1,
    open_served: Callable[..., ModelRun] | None = None,
) -> dict[str, dict[str, Any]]:
    """Embed the tiles of `tiles_path` with the models of `settings` (by key, in order);
    write each one's store and metrics.json to its `outputs`; return the metrics of those
    embedded. `params`: the rule's params of the models of `models:`, which make them a
    list (above). `jobs_on_gpu`: how many jobs may share this job's GPU, for the check
    that a list's local models fit it. `open_served(settings, spec, input, slide_id)`:
    a served model's run, connected."""
    clock = {"process": process_started(), "entered": time.perf_counter()}
    if params is None:
        return _Job(slide_path, slide_id, tiles_path, settings, clock).embed(
            outputs, device, open_served
        )
    keys = embedding_keys({key: params[key] for key in settings}, tiles_path, slide_path)
    waiting, stale = models_not_in_place(outputs, keys, slide_id)
    metrics: dict[str, dict[str, Any]] = {}
    if stale:
        stale_settings = {key: settings[key] for key in stale}
        job = _Job(slide_path, slide_id, tiles_path, stale_settings, clock, keys)
        kept = {key: outputs[key].kept() for key in stale}
        metrics = job.embed(kept, device, open_served, jobs_on_gpu)
        if job.failed:
            done = [key for key in stale if key not in job.failed]
            raise models_failed(slide_id, job.failed, done)
    for key in [*waiting, *stale]:
        outputs[key].kept().move_to(outputs[key])
    return metrics


class _Job:
    """The models of one job to embed, from one read of the slide (`keys`: the embedding
    keys of a list's models, which their outputs record)."""

    def __init__(
        self, slide_path, slide_id: str, tiles_path, settings: dict[str, EmbedSettings],
        clock: dict[str, float], keys: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.slide_path, self.slide_id, self.settings = slide_path, slide_id, settings
        self.clock, self.keys, self.listed = clock, keys, keys is not None
        tiles, self.geometry = read_tiles(tiles_path)
        self.coords = tiles[["x", "y"]].to_numpy(np.int64)
        self.loader = next(iter(settings.values()))  # loader.* is the run's, for every model
        self.batch_size = min(s.tiles_per_batch for s in settings.values())  # fits all
        self.failed: dict[str, Exception] = {}

    def embed(self, places: dict[str, ModelOutputs], device, open_served, jobs_on_gpu=1):
        """The metrics of the models that finished; `failed` holds the others' errors."""
        wanted = {key: self._wanted(key) for key in self.settings}
        local = [key for key, s in self.settings.items() if s.backend == "local"]
        served = [key for key in self.settings if key not in local]
        if served and open_served is None:
            raise ConfigError(f"models {', '.join(served)} are served, and this caller serves none")
        self.device = self._device(local, wanted, device, jobs_on_gpu)
        with ExitStack() as job:
            runs = self._open(served, open_served, wanted, self.slide_id, job)
            dataset = TileBatches(
                self.slide_path, self.slide_id, self.coords, self.geometry, self.batch_size,
                self.loader.block, self.loader.decode,
            )  # fmt: skip
            self.clock["loader"] = time.perf_counter()
            batches = job.enter_context(dataset.stream(self.loader.workers, self.loader.prefetch))
            runs, to_device = self._open_local(runs, local, wanted, batches, dataset, job)
            if not runs:
                return {}
            self._log_start(runs)
            stores = job.enter_context(output_set([places[key].zarr for key in runs]))
            writers = self._writers(runs, stores, places)
            timings, failed = run_models(
                list(runs.values()), list(writers.values()), batches, self.loader, to_device
            )
            self._failed({list(runs)[index]: err for index, err in failed.items()})
            timings |= self._startup(timings.pop("first_batch_at"))
            slide = slide_attributes(
                self.slide_path, self.slide_id, self.geometry, dataset.slide_stat
            )
            self._finish(runs, writers, stores, places, slide | dataset.read_attributes, timings)
        return self._write_metrics(runs, places, timings)

    def _wanted(self, key: str) -> tuple[ModelSpec, ModelInput]:
        settings = self.settings[key]
        spec = model_spec(settings.model, settings.mean, settings.std)
        label = f"models.{key}" if self.listed else "model"
        tiles = self.geometry.size, self.geometry.target_mpp
        return spec, model_input(spec, *tiles, settings.input_size, settings.input_mpp, label)

    def _device(self, local: list[str], wanted: dict, device, jobs_on_gpu: int):
        """This job's device where it runs local models (None: it runs none)."""
        if not local:
            return None
        from slidesnake.embed.local_run import check_fits, slide_device

        device = device or slide_device()
        if self.listed:
            check_fits(
                {key: (wanted[key][0], self.settings[key]) for key in local}, device, jobs_on_gpu
            )
        return device

    def _open_local(self, runs: dict, local: list[str], wanted, batches, dataset, job) -> tuple:
        """After the loader's fork, so that the models load while the workers read: the
        local models, joined to the served ones in the config's order, and what puts each
        batch on their device."""
        to_device = None
        if local:
            from slidesnake.embed.local_run import DeviceFeed, open_local

            runs |= self._open(local, open_local, wanted, self.device, job)
            shared = sum(key in runs for key in local) > 1
            to_device = DeviceFeed(self.device, batches, dataset.batch_shape, shared)
        self.clock["models_ready"] = time.perf_counter()
        return {key: runs[key] for key in self.settings if key in runs}, to_device

    def _open(self, keys: list[str], opener, wanted: dict, where, job: ExitStack) -> dict:
        """Each of these models ready to embed, `opener(settings, spec, input, where)`;
        one that cannot be opened (its weights, its server) fails alone in a list."""
        runs = {}
        for key in keys:
            try:
                runs[key] = opener(self.settings[key], *wanted[key], where)
            except Exception as err:
                self._failed({key: err})
            else:
                job.callback(runs[key].close)
        return runs

    def _failed(self, errors: dict[str, Exception]) -> None:
        """Record models' errors; the run's one model's error is the job's."""
        if errors and not self.listed:
            raise next(iter(errors.values()))
        self.failed |= errors

    def _writers(self, runs: dict[str, ModelRun], stores: OutputSet, places) -> dict:
        """Each model's store, in its place in the output set."""
        return {
            key: EmbeddingWriter(
                stores.path(places[key].zarr), self.coords, run.dim, self.settings[key].output_dtype
            )
            for key, run in runs.items()
        }

    def _startup(self, first_batch: float) -> dict[str, float]:
        """The fixed cost, process start to the first batch handed to the models, and its
        parts: imports (and the interpreter), the loader's plan, and the wait for the
        first batch after the models were ready."""
        clock = self.clock
        return {
            "startup_s": first_batch - clock["process"],
            "imports_s": clock["entered"] - clock["process"],
            "loader_start_s": clock["loader"] - clock["entered"],
            "first_batch_after_model_s": first_batch - clock["models_ready"],
        }

    def _finish(self, runs, writers, stores: OutputSet, places, slide: dict, timings) -> None:
        """Record each finished store's attributes; drop the stores of failed models."""
        for key, run in runs.items():
            if key not in self.failed:
                listing = {"model_key": key, "embedding_key": self.keys[key]} if self.listed else {}
                attributes = slide | listing | run.attributes(self.listed) | {"timings": timings}
                try:
                    writers[key].finish(attributes)
                except Exception as err:
                    self._failed({key: err})
            if key in self.failed:
                stores.drop(places[key].zarr)
                places[key].remove()

    def _write_metrics(self, runs: dict[str, ModelRun], places, timings: dict) -> dict:
        """Each finished model's metrics, written beside its store."""
        shared = self._job_metrics(list(runs))
        metrics = {
            key: self._metrics(key, run, timings, shared)
            for key, run in runs.items()
            if key not in self.failed
        }
        for key, values in metrics.items():
            with atomic_output(places[key].metrics) as tmp:
                tmp.write_text(json.dumps(values, indent=2) + "\n")
        if metrics:
            self._log_done(timings, metrics)
        return metrics

    def _job_metrics(self, keys: list[str]) -> dict[str, Any]:
        """What every model of the job shares: the whole job's time, its device, batches."""
        device = "cpu"
        if self.device is not None:
            from slidesnake.embed.local_run import device_name

            device = device_name(self.device)
        return {
            **({"models_in_job": keys} if self.listed else {}),
            "job_s": round(time.perf_counter() - self.clock["process"], 3),
            "device": str(self.device or "cpu"),
            "device_name": device,
            "batch_size": self.batch_size,
            "loader_workers": self.loader.workers,
        }

    def _metrics(self, key: str, run: ModelRun, timings: dict, job: dict) -> dict[str, Any]:
        """One model's metrics: its own time and tiles/s, and the job's (the read, the
        loop's wait for data, the start-up), which every model of the job shares."""
        tiles = len(self.coords)
        startup = ("startup_s", "imports_s", "loader_start_s", "first_batch_after_model_s")
        return {
            **loop_rates(tiles, timings),
            **model_time(run.model_s(), tiles, job["job_s"]),
            **{name: round(timings[name], 3) for name in startup},
            **read_counts(timings),
            **job,
            **({"model_key": key} if self.listed else {}),
            **run.metrics(),
            **peak_memory_mb(),
            **({"embedding_key": self.keys[key]} if self.listed else {}),
        }

    def _log_start(self, runs: dict[str, ModelRun]) -> None:
        for key, run in runs.items():
            named = f"model {key}:" if self.listed else "model"
            log.info("slide '%s': %s %s", self.slide_id, named, run.describe())
        read = f"read once for models {', '.join(runs)}" if self.listed else "read"
        log.info(
            "slide '%s': %d tiles %s on %s (CUDA_VISIBLE_DEVICES=%s), %d loader workers, "
            "batch %d",
            self.slide_id, len(self.coords), read, self.device or "cpu",
            os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), self.loader.workers, self.batch_size,
        )  # fmt: skip

    def _log_done(self, timings: dict, metrics: dict[str, dict]) -> None:
        tiles, wall = len(self.coords), max(timings["wall_s"], 1e-9)
        each = ", ".join(f"{key} {m['model_s']:.1f} s" for key, m in metrics.items())
        each = each if self.listed else f"{next(iter(metrics.values()))['model_s']:.1f} s"
        log.info(
            "slide '%s': %d tiles in %.1f s, %.1f tiles/s, %d compressed tiles decoded once "
            "(model time: %s), loader wait %.0f%%; start-up %.1f s, whole job %.1f s",
            self.slide_id, tiles, timings["wall_s"], tiles / wall,
            timings["compressed_tiles_decoded"], each, 100 * timings["loader_wait_s"] / wall,
            timings["startup_s"], next(iter(metrics.values()))["job_s"],
        )  # fmt: skip
