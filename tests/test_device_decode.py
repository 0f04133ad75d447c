"""loader.decode: gpu: workers hand JPEG tiles over compressed and nvImageCodec decodes them
where the model runs. Here that is the CPU (nvImageCodec's libjpeg-turbo backend), so
these tests check the path's CPU side: the packing, the cutting of model tiles from the
decoded streams, the probe, the errors and the records; docs/benchmarks.md says what the
GPU check adds."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from test_embedding import (  # noqa: F401
    blob_40x,
    check_against_reference,
    embed,
    grid_model,
    tile_slide,
)
from test_embedding import settings as embed_settings
from test_scaled_decode import REAL_RGB_SLIDE, slide_40x_j2k, tiles_of  # noqa: F401
from test_tile_loader import slide_40x, tiled  # noqa: F401

from slidesnake.embed.device_decode import DeviceDecoder
from slidesnake.embed.settings import EmbedSettings
from slidesnake.errors import ConfigError, SlideReadError
from slidesnake.loader.batches import TileBatches, tile_reader
from slidesnake.loader.compressed_batches import PackedBatch, StreamPacker
from slidesnake.slides.slide import Slide
from slidesnake.tiling.tile_table import read_tiles

pytest.importorskip("nvidia.nvimgcodec", reason="needs nvImageCodec (pip install -e '.[dev]')")
CPU = torch.device("cpu")


def decoded_on_device(
    slide: Path, tiles_path: Path, coords=None, workers: int = 0, batch=16, device=CPU
):
    """Every tile of `tiles_path` (or at `coords`) through the gpu path, in table order."""
    table, geometry = read_tiles(tiles_path)
    coords = table[["x", "y"]].to_numpy(np.int64) if coords is None else coords
    dataset = TileBatches(slide, "s", coords, geometry, batch, decode="gpu")
    got, sizes = {}, []
    with dataset.stream(workers, 2) as batches:
        decoder = DeviceDecoder(device, dataset.plan.tile_px, batches.device_probe)
        for rows, packed in batches:
            assert isinstance(packed, PackedBatch)
            sizes.append(int(packed.table.ends[-1]))
            tiles = decoder(packed).cpu().numpy()
            got |= {row: tile for row, tile in zip(rows.tolist(), tiles, strict=True)}
    return dataset, np.stack([got[row] for row in range(len(coords))]), sizes


@pytest.mark.parametrize("workers", [0, 2])
def test_tiles_decoded_on_the_device_are_the_exact_paths(tmp_path, slide_40x, workers):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    _, exact = tiles_of(slide_40x, tiles_path, "exact")
    dataset, gpu, sizes = decoded_on_device(slide_40x, tiles_path, workers=workers)
    assert dataset.packed and dataset.plan.shrink == 1
    assert dataset.read_attributes == {"decode": "gpu", "decode_shrink": 1, "decoded_on": "device"}
    assert gpu.shape == exact.shape and np.array_equal(gpu, exact)
    # Compressed, a batch is a fraction of its pixels' bytes.
    assert max(sizes) < 16 * 448 * 448 * 3 / 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_nvjpeg_gives_the_cpus_pixels_within_a_grey_level(tmp_path, slide_40x):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    _, exact = tiles_of(slide_40x, tiles_path, "exact")
    _, gpu, _ = decoded_on_device(slide_40x, tiles_path, device=torch.device("cuda"))
    difference = np.abs(gpu.astype(np.int16) - exact)
    assert difference.mean() <= 1.0 and np.percentile(difference, 99) <= 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, bounded by the test above")
def test_the_embedding_job_on_the_gpu_path_equals_the_model_on_tiles_read_one_by_one(
    tmp_path,
    blob_40x,  # noqa: F811
    grid_model,  # noqa: F811
):
    tiles_path = tile_slide(blob_40x, tmp_path)
    features, coords, attributes, metrics = embed(
        blob_40x, tiles_path, tmp_path, embed_settings(grid_model, decode="gpu")
    )
    check_against_reference(blob_40x, tiles_path, features, coords)
    assert attributes["decode"] == "gpu" and attributes["decoded_on"] == "device"
    assert metrics["compressed_tiles_decoded"] > 0


def test_tiles_partly_outside_the_level_are_white_there(tmp_path, slide_40x):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    corner = np.array([[8000 - 200, 6000 - 100], [0, 0], [8000 - 448, 0]], np.int64)
    _, exact = tiles_of(slide_40x, tiles_path, "exact", corner)
    _, gpu, _ = decoded_on_device(slide_40x, tiles_path, corner)
    assert np.array_equal(gpu, exact)
    assert (gpu[0, 100:, :] == 255).all() and (gpu[0, :, 200:] == 255).all()


def test_a_full_slot_ends_the_batch_and_a_tile_too_big_for_one_is_refused(tmp_path, slide_40x):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    table, geometry = read_tiles(tiles_path)
    coords = table[["x", "y"]].to_numpy(np.int64)[:8]
    plan = TileBatches(slide_40x, "s", coords, geometry, 8, decode="gpu").plan
    slide = Slide(slide_40x, "s", geometry.slide_mpp)
    reader, positions = tile_reader(slide, plan, coords, packed=True)
    cell = reader.open_cell(positions)
    one = StreamPacker(reader, np.empty(10**7, np.uint8))
    assert one.add(cell, 0)
    room = int(one.table().ends[-1]) + 10  # the first tile's streams and a little more
    packer = StreamPacker(reader, np.empty(room, np.uint8))
    assert packer.add(cell, 0) and not packer.add(cell, 4)  # 4: other compressed tiles
    assert len(packer.table().blank) == 1
    with pytest.raises(ConfigError, match=r"raise loader\.batch_size"):
        StreamPacker(reader, np.empty(100, np.uint8)).add(cell, 0)
    slide.close()


def test_a_corrupt_tile_fails_its_slide_naming_the_place(tmp_path, slide_40x):  # noqa: F811
    broken = tmp_path / "broken.svs"
    shutil.copy(slide_40x, broken)
    with tifffile.TiffFile(broken) as tiff:
        page = tiff.pages[0]
        offset, count = page.dataoffsets[0], page.databytecounts[0]  # the corner, not the probe's
    with open(broken, "r+b") as fh:
        fh.seek(offset + 2)  # keep the SOI, break what follows
        fh.write(b"\x00" * (count - 2))
    tiles_path = tiled(slide_40x, tmp_path)
    corner = np.array([[0, 0]], np.int64)
    with pytest.raises(
        SlideReadError, match=r"level 0, \(0, 0\) could not be decoded on the device"
    ):
        decoded_on_device(broken, tiles_path, corner)


@pytest.mark.real_slides
@pytest.mark.skipif(not REAL_RGB_SLIDE.is_file(), reason="needs ../shared/slides")
def test_aperio_rgb_tiles_keep_their_colours_and_a_guess_gone_wrong_is_refused(
    tmp_path, monkeypatch
):
    """Aperio's photometric-RGB tiles decode as the CPU decodes them (the Adobe marker);
    without it they are taken for YCbCr, and the probe refuses the decoder."""
    from slidesnake.slides import jpeg_streams

    tiles_path = tiled(REAL_RGB_SLIDE, tmp_path)
    _, exact = tiles_of(REAL_RGB_SLIDE, tiles_path, "exact")
    _, gpu, _ = decoded_on_device(REAL_RGB_SLIDE, tiles_path)
    assert np.array_equal(gpu, exact)
    monkeypatch.setattr(jpeg_streams, "_ADOBE_RGB", b"")
    with pytest.raises(ConfigError, match=r"other pixels .* set loader\.decode to exact"):
        decoded_on_device(REAL_RGB_SLIDE, tiles_path)


def test_a_level_the_device_does_not_decode_is_read_by_the_workers(tmp_path, slide_40x_j2k):  # noqa: F811
    tiles_path = tiled(slide_40x_j2k, tmp_path)
    dataset, gpu = tiles_of(slide_40x_j2k, tiles_path, "gpu")
    _, exact = tiles_of(slide_40x_j2k, tiles_path, "exact")
    assert not dataset.packed and np.array_equal(gpu, exact)
    assert dataset.read_attributes["decoded_on"] == "loader"


def test_without_nvimagecodec_the_job_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    with pytest.raises(ConfigError, match=r"pip install 'slidesnake\[gpu-decode\]'"):
        DeviceDecoder(CPU, 448, None)


def test_a_served_model_does_not_take_gpu_decode():
    config = {
        "model": {"name": "h-optimus-0"},
        "loader": {"decode": "gpu"},
        "embed": {"backend": "remote"},
        "remote": {"url": "http://localhost:8000", "model": "h0"},
    }
    with pytest.raises(ConfigError, match="not for a served one"):
        EmbedSettings.from_config(config)
