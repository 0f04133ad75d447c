"""slidesnake: whole-slide images to tile embeddings, one Snakemake job per slide per stage.

The public names are imported on first use: a process that needs one subpackage (a job's
stage, or the server, whose environment has no zarr or OpenSlide) pays for no other.
"""

from importlib import import_module
from importlib.metadata import version

from slidesnake.errors import (
    ConfigError,
    EmbeddingsError,
    ModelError,
    MppError,
    RemoteError,
    SampleSheetError,
    SlideError,
    SlideOpenError,
    SlideReadError,
    SlidesnakeError,
)

__version__ = version("slidesnake")

_LAZY = {
    "export_h5": "slidesnake.embed.store",
    "load_embeddings": "slidesnake.embed.store",
    "Slide": "slidesnake.slides.slide",
    "TissueMask": "slidesnake.tiling.mask_file",
    "load_mask": "slidesnake.tiling.mask_file",
    "read_tiles": "slidesnake.tiling.tile_table",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'slidesnake' has no attribute '{name}'")
    return getattr(import_module(_LAZY[name]), name)


__all__ = [
    "ConfigError",
    "EmbeddingsError",
    "ModelError",
    "MppError",
    "RemoteError",
    "SampleSheetError",
    "Slide",
    "SlideError",
    "SlideOpenError",
    "SlideReadError",
    "SlidesnakeError",
    "TissueMask",
    "__version__",
    "export_h5",
    "load_embeddings",
    "load_mask",
    "read_tiles",
]
