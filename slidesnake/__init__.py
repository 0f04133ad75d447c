"""slidesnake: whole-slide images to tile embeddings, one Snakemake job per slide per stage."""

from importlib.metadata import version

from slidesnake.embedding_store import export_h5, load_embeddings
from slidesnake.errors import (
    ConfigError,
    ModelError,
    MppError,
    SampleSheetError,
    SlideError,
    SlideOpenError,
    SlideReadError,
    SlidesnakeError,
)
from slidesnake.maskfile import TissueMask, load_mask
from slidesnake.slide import Slide
from slidesnake.tile_table import read_tiles

__version__ = version("slidesnake")

__all__ = [
    "ConfigError",
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
