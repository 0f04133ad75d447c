"""slidesnake: whole-slide images to tile embeddings, one Snakemake job per slide per stage."""

from importlib.metadata import version

from slidesnake.embed.store import export_h5, load_embeddings
from slidesnake.errors import (
    ConfigError,
    EmbeddingsError,
    ModelError,
    MppError,
    SampleSheetError,
    SlideError,
    SlideOpenError,
    SlideReadError,
    SlidesnakeError,
)
from slidesnake.slides.slide import Slide
from slidesnake.tiling.mask_file import TissueMask, load_mask
from slidesnake.tiling.tile_table import read_tiles

__version__ = version("slidesnake")

__all__ = [
    "ConfigError",
    "EmbeddingsError",
    "ModelError",
    "MppError",
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
