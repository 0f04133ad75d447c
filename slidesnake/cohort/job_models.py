"""The models of one embedding job, read from its config in one place: each one's
settings, outputs and (for the models of `models:`) the params its outputs record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidesnake.cohort.rule_params import embedding_params
from slidesnake.embed.job import ONE_MODEL
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.settings import EmbedSettings, model_configs


@dataclass(frozen=True)
class JobModels:
    """By key, in the order the config lists them (as the rule lists their outputs)."""

    settings: dict[str, EmbedSettings]
    outputs: dict[str, ModelOutputs]
    params: dict[str, dict[str, Any]] | None  # None: the run's one `model:`

    @property
    def served(self) -> bool:
        return any(settings.backend == "remote" for settings in self.settings.values())

    @property
    def local(self) -> bool:
        return any(settings.backend == "local" for settings in self.settings.values())


def job_models(
    config: Mapping[str, Any], zarr: str | Path | Sequence, metrics: str | Path | Sequence
) -> JobModels:
    """The job's models: those of `models:`, else the run's one `model:`, writing to the
    rule's `zarr` and `metrics` outputs (one each, or one each per model)."""
    configs = model_configs(config)
    if not configs:
        outputs = {ONE_MODEL: ModelOutputs(Path(zarr), Path(metrics))}
        return JobModels({ONE_MODEL: EmbedSettings.from_config(config)}, outputs, None)
    paths = zip(configs, zarr, metrics, strict=True)
    return JobModels(
        {key: EmbedSettings.from_config(model) for key, model in configs.items()},
        {key: ModelOutputs(Path(store), Path(record)) for key, store, record in paths},
        {key: embedding_params(model) for key, model in configs.items()},
    )
