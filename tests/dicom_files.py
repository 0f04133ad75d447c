"""DICOM whole-slide images made from real pixels, for the DICOM tests: a pyramid of VL
Whole Slide Microscopy instances (TILED_FULL, JPEG baseline frames), one file per level,
built on the attributes of OpenSlide's own DICOM test slide (../shared/slides)."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import imagecodecs
import numpy as np
import pydicom
from pydicom.encaps import encapsulate
from pydicom.uid import JPEGBaseline8Bit, generate_uid

from slidesnake.slides.lowres import bin_pixels

TILE = 256


def write_dicom_pyramid(
    rgb: np.ndarray, mpp: float, folder: Path, template: Path, levels: int = 3
) -> list[Path]:
    """`rgb` as a DICOM series in `folder`: level 0 and each halving below it."""
    folder.mkdir(parents=True, exist_ok=True)
    base = pydicom.dcmread(template)
    uids = {"StudyInstanceUID": generate_uid(), "SeriesInstanceUID": generate_uid(),
            "PyramidUID": generate_uid(), "FrameOfReferenceUID": generate_uid()}  # fmt: skip
    paths = []
    for level in range(levels):
        pixels = bin_pixels(rgb, 2**level)
        ds = _instance(base, pixels, mpp * 2**level, level, uids)
        path = folder / f"level-{level}.dcm"
        ds.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths


def _instance(base, pixels: np.ndarray, mpp: float, level: int, uids: dict) -> pydicom.Dataset:
    ds = deepcopy(base)
    for key, value in uids.items():
        setattr(ds, key, value)
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE" if level == 0 else "RESAMPLED"]
    height, width = pixels.shape[:2]
    ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = width, height
    ds.Rows = ds.Columns = TILE
    ds.PhotometricInterpretation = "YBR_FULL_422"
    ds.ImagedVolumeWidth, ds.ImagedVolumeHeight = width * mpp / 1000, height * mpp / 1000
    measures = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    measures.PixelSpacing = [f"{mpp / 1000:.9f}", f"{mpp / 1000:.9f}"]
    frame_type = ds.SharedFunctionalGroupsSequence[0].WholeSlideMicroscopyImageFrameTypeSequence[0]
    frame_type.FrameType = ds.ImageType
    frames = [imagecodecs.jpeg_encode(tile, level=90) for tile in _tiles(pixels)]
    ds.NumberOfFrames = len(frames)
    ds.PixelData = encapsulate(frames)
    ds["PixelData"].VR = "OB"
    ds.InstanceNumber = level + 1
    return ds


def _tiles(pixels: np.ndarray):
    """TILED_FULL order, row by row; edge tiles padded with white."""
    height, width = pixels.shape[:2]
    for top in range(0, height, TILE):
        for left in range(0, width, TILE):
            tile = np.full((TILE, TILE, 3), 255, np.uint8)
            part = pixels[top : top + TILE, left : left + TILE]
            tile[: part.shape[0], : part.shape[1]] = part
            yield tile
