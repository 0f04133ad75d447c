"""The settings of an embedding job: config sections model.*, loader.*, output.*, embed.*.

Pure data without torch, so the command line and the workflow can read them cheaply.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from slidesnake.errors import ConfigError


@dataclass(frozen=True)
class RemoteSettings:
    """remote.* of the config: where the inference server is and how to talk to it."""

    url: str | tuple[str, ...]  # several: one server per GPU, slides spread over them
    model: str
    max_concurrency: int = 8
    batch_size: int = 32
    timeout_s: float = 60.0
    retries: int = 5
    ready_timeout_s: float = 600.0
    token_env: str | None = None
    verify_tls: bool = True

    def server_for(self, slide_id: str) -> str:
        """The server of this slide: the same one on every run, the slides of a cohort
        spread evenly over the servers."""
        if isinstance(self.url, str):
            return self.url
        return self.url[zlib.crc32(slide_id.encode()) % len(self.url)]


@dataclass(frozen=True)
class EmbedSettings:
    """model.*, loader.*, output.* and embed.* of the config."""

    model: str = "h-optimus-0"
    weights: str = "checkpoint"  # or "random" (demos and tests only)
    checkpoint: str | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    precision: str = "fp16"
    batch_size: int = 64
    input_size: int | None = None  # px the model takes; None: its own, else the tile's
    input_mpp: float | None = None  # µm/px it sees; None: its own, else the tile's
    workers: int = 4
    prefetch: int = 2
    block: int = 4
    decode: str = "exact"  # "scaled": JPEG tiles decoded at the model's scale; "gpu": there
    output_dtype: str = "float16"
    progress_s: float = 30.0
    watchdog_s: float = 300.0
    backend: str = "local"  # or "remote": an inference server embeds, see `remote`
    remote: RemoteSettings | None = None

    @property
    def tiles_per_batch(self) -> int:
        """The batch a job reads for this model: a served model's is its requests' size."""
        return self.remote.batch_size if self.backend == "remote" else self.batch_size

    @classmethod
    def from_config(cls, config: Mapping[str, Mapping[str, Any]]) -> EmbedSettings:
        """Flatten the config sections into settings (model.name -> model, ...)."""
        flat = {**config.get("model", {}), **config.get("loader", {})}
        flat |= {f"output_{k}": v for k, v in config.get("output", {}).items()}
        flat |= dict(config.get("embed", {}))
        flat["model"] = flat.pop("name", cls.model)
        names = {f.name for f in fields(cls)} - {"remote"}
        settings = {k: v for k, v in flat.items() if k in names and v is not None}
        if settings.get("backend") == "remote":
            remote = dict(config["remote"])
            if isinstance(remote["url"], list):
                remote["url"] = tuple(remote["url"])
            remote = RemoteSettings(**remote)
            settings |= {"remote": remote, "batch_size": remote.batch_size}
            if settings.get("decode") == "gpu":
                raise ConfigError(
                    "loader.decode gpu decodes where a local model runs, not for a served "
                    "one. Fix: set loader.decode to exact or scaled for backend remote"
                )
        return cls(**settings)


def model_configs(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each model of `models:` as a config of its own, its entry in place of `model:` (and
    the entry's `remote:` in place of the run's), in the order the config lists them;
    none for a config with one `model:`."""
    configs = {}
    for key, entry in (config.get("models") or {}).items():
        model = {name: value for name, value in entry.items() if name != "remote"}
        configs[key] = {**config, "model": model, "remote": entry.get("remote", config["remote"])}
    return configs


# `make demo` and `slidesnake bench`: a small ViT that a CPU runs at ~20 tiles/s.
DEMO = EmbedSettings(
    model="timm:vit_tiny_patch16_224", weights="random", precision="fp32", batch_size=32
)
