"""A slide encoder: a program of the user's that maps a slide's tile features and their
coordinates to one vector (TITAN-, PRISM- or GigaPath-style encoders, from local weights).

The program is loaded with the same checks as a tile model's (nothing in the file runs
before it is called) and gets (N, D) float32 features and (N, 2) float32 level-0
coordinates; it must return one vector. It sees every tile at once, which is what such
encoders need: its memory is the slide's features.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from slidesnake.embed.store import open_embeddings
from slidesnake.errors import ModelError
from slidesnake.finite import require_finite
from slidesnake.models.checkpoints import load_program

# A column per value in slide_features.parquet: wider than any published slide encoder.
MAX_WIDTH = 65_536


def encode_slide(program_path: str | Path, zarr_path: str | Path) -> np.ndarray | None:
    """The program's vector for the slide (float32), or None for a slide of 0 tiles."""
    group = open_embeddings(zarr_path)
    if group["features"].shape[0] == 0:
        return None
    features = torch.from_numpy(group["features"][:].astype(np.float32))
    coords = torch.from_numpy(group["coords"][:].astype(np.float32))
    program = load_program(program_path, torch.device("cpu"))
    try:
        with torch.inference_mode():
            vector = program(features, coords)
    except Exception as err:
        raise ModelError(
            f"slide.encoder {program_path} fails on {tuple(features.shape)} features and "
            f"{tuple(coords.shape)} coordinates ({err}); it must take both"
        ) from None
    if not isinstance(vector, torch.Tensor):
        raise ModelError(
            f"slide.encoder {program_path} returns a {type(vector).__name__}; it must "
            "return one tensor, a vector per slide"
        )
    vector = vector.detach().float().squeeze(0)
    if vector.ndim != 1 or len(vector) > MAX_WIDTH:
        raise ModelError(
            f"slide.encoder {program_path} returns shape {tuple(vector.shape)}; it must "
            f"return one vector per slide, of at most {MAX_WIDTH} values"
        )
    vector = vector.numpy()
    require_finite(vector, f"slide.encoder {program_path}'s vector",
                   "check the encoder's weights, and that it takes float32 features")  # fmt: skip
    return vector
