"""Where one model's outputs for one slide go, and where they wait when another model of
the same job fails.

Snakemake removes every new output of a failed job, even one flagged `update`. So the
models of a job write into a `.kept` folder beside their outputs, and their stores move
into place only once every model of the job has finished: a model that fails costs only
itself, and the next run takes the kept stores of the others instead of embedding again.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from slidesnake.atomic import remove_output
from slidesnake.embed.store import open_embeddings
from slidesnake.errors import EmbeddingsError

KEPT = ".kept"


@dataclass(frozen=True)
class ModelOutputs:
    """One model's embeddings store and metrics for one slide."""

    zarr: Path
    metrics: Path

    def kept(self) -> ModelOutputs:
        """Where these outputs wait for the other models of their job."""
        return ModelOutputs(
            self.zarr.parent / KEPT / self.zarr.name, self.metrics.parent / KEPT / self.metrics.name
        )

    def is_current(self, key: str) -> bool:
        """Both outputs exist, finished, and record the embedding key `key`."""
        try:
            recorded = json.loads(self.metrics.read_text()).get("embedding_key")
            store = open_embeddings(self.zarr)
            return recorded == key and store.attrs.get("embedding_key") == key
        except (OSError, ValueError, AttributeError, EmbeddingsError):
            return False

    def move_to(self, final: ModelOutputs) -> None:
        """Replace `final` with these outputs, the store first: a job killed in between
        leaves a store and metrics of two keys, which are not current, and redone."""
        for here, there in ((self.zarr, final.zarr), (self.metrics, final.metrics)):
            remove_output(there)
            os.replace(here, there)
        self._remove_folders()

    def remove(self) -> None:
        for path in (self.zarr, self.metrics):
            remove_output(path)
        self._remove_folders()

    def _remove_folders(self) -> None:
        """The kept folders, once empty."""
        for folder in {self.zarr.parent, self.metrics.parent}:
            with suppress(OSError):
                folder.rmdir()
