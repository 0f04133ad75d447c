"""Hostile side files: regions, coordinates, heads, encoders and checkpoints that are not
what they say. Each fails its slide (or the run, before any job, for what the config
names) with one line naming the slide, the file and what is wrong, within a bound on
time and memory; nothing that looks finished is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import RECT_TISSUE, REPO

from slidesnake.cohort.config import check_config_files
from slidesnake.cohort.samples import read_sample_sheet
from slidesnake.errors import ConfigError, SampleSheetError
from slidesnake.side_files import MAX_BYTES
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.imported import CoordsError
from slidesnake.tiling.regions import RegionError, read_regions
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams

T = 448  # level-0 px of a tile on the 0.25 µm/px rect slide


@pytest.fixture(scope="module")
def rect_mask(tmp_path_factory, rect_slide) -> Path:
    out = tmp_path_factory.mktemp("rect-mask")
    make_tissue_mask(rect_slide, "rect", out / "mask.png", out / "qc.png", TissueParams())
    return out


def tile_with(rect_slide, rect_mask, tmp_path, roi=None, coords=None):
    regions = read_regions(roi, "rect") if roi else None
    make_tile_coords(
        rect_slide, "rect", rect_mask / "mask.png", rect_mask / "qc.png",
        tmp_path / "tiles.parquet", tmp_path / "qc_tiles.png", TileParams(), regions, roi,
        coords_path=coords,
    )  # fmt: skip
    return read_tiles(tmp_path / "tiles.parquet")[0]


def measured(code: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `code` in a fresh interpreter: (result, wall seconds, its peak memory in MB)."""
    # VmHWM, not ru_maxrss: the latter survives exec, so a child of pytest starts at its size.
    script = code + textwrap.dedent("""
        import re
        status = open("/proc/self/status").read()
        kb = int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1))
        print(f"peak_mb={kb / 1024:.0f}")
    """)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s
    )
    wall = time.monotonic() - started
    peaks = [line for line in result.stdout.splitlines() if line.startswith("peak_mb=")]
    return result, wall, float(peaks[-1].split("=")[1]) if peaks else float("nan")


# --- paths that are not files ----------------------------------------------------------


def test_side_files_that_are_not_regular_files_stop_the_sheet(tmp_path, rect_slide):
    os.mkfifo(tmp_path / "pipe.geojson")
    (tmp_path / "folder.csv").mkdir()
    sheet = tmp_path / "s.tsv"
    sheet.write_text(
        "slide_id\tpath\troi\tcoords\n"
        f"a\t{rect_slide}\tpipe.geojson\t\n"
        f"b\t{rect_slide}\t\tfolder.csv\n"
        f"c\t{rect_slide}\t/dev/zero\t\n"
        f"d\t{rect_slide}\tgone.geojson\t\n"  # a missing file fails its own slide's jobs
    )
    with pytest.raises(SampleSheetError) as raised:
        read_sample_sheet(sheet, base_dir=tmp_path)
    lines = str(raised.value).splitlines()[1:]
    assert len(lines) == 3, lines
    assert "slide 'a': roi pipe.geojson is not a regular file" in lines[0]
    assert "slide 'b': coords folder.csv is a directory" in lines[1]
    assert "slide 'c': roi /dev/zero is not a regular file" in lines[2]


@pytest.mark.parametrize("kind", ["fifo", "device", "too large"])
def test_parsers_refuse_what_is_not_a_side_file_without_reading_it(tmp_path, kind):
    if kind == "fifo":
        os.mkfifo(tmp_path / "r.geojson")
        path, problem = tmp_path / "r.geojson", "is not a regular file"
    elif kind == "device":
        path, problem = Path("/dev/zero"), "is not a regular file"
    else:
        path = tmp_path / "r.geojson"
        with path.open("wb") as f:
            f.truncate(MAX_BYTES["regions"] + 1)  # sparse: costs no disk
        problem = "holds 100 MB, more than the 100 MB allowed"
    started = time.monotonic()
    with pytest.raises(RegionError, match=f"slide 'rect' \\({path}\\): the regions file {problem}"):
        read_regions(path, "rect")
    assert time.monotonic() - started < 2


def test_files_the_config_names_are_checked_before_any_job(tmp_path):
    os.mkfifo(tmp_path / "head.pt")
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["model"]["checkpoint"] = "/dev/zero"
    config["head"]["checkpoint"] = str(tmp_path / "head.pt")
    config["slide"]["encoder"] = str(tmp_path)
    with pytest.raises(ConfigError) as raised:
        check_config_files(config)
    lines = [line.strip() for line in str(raised.value).splitlines()[1:]]
    assert lines == [
        "model.checkpoint: /dev/zero is not a regular file (a pipe, socket or device would "
        "block or never end); correct the path",
        f"head.checkpoint: {tmp_path}/head.pt is not a regular file (a pipe, socket or device "
        "would block or never end); correct the path",
        f"slide.encoder: {tmp_path} is a directory, not a file; correct the path",
    ]
    config["model"]["backend"] = "remote"  # the server's file, not ours to check
    config["head"]["checkpoint"] = config["slide"]["encoder"] = None
    check_config_files(config)


# --- regions: malformed, numbers that are not numbers, bombs ---------------------------


def square(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"type": "FeatureCollection", "features": 5}', "it is not GeoJSON of features"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": 7}}',
         "feature 0 has a malformed geometry (a Polygon needs a list of rings)"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": '
         '[[["a", 1], [2, 3], [4, 5]]]}}', "positions must be numbers"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": '
         '[[[true, false], [true, true], [false, true]]]}}', "positions must be numbers"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": '
         '[[[NaN, 1], [2, 3], [4, 5]]]}}', "a position is not finite"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": '
         '[[[1e300, 1], [2, 3], [4, 5]]]}}', "a position is not finite or lies beyond"),
        ('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[1, 2]]]}}',
         "a ring needs at least 3 positions"),
        ("", "cannot be read as GeoJSON"),
        ("\xff\xfe", "cannot be read as GeoJSON"),
    ],
)  # fmt: skip
def test_a_malformed_regions_file_is_one_line_naming_it(tmp_path, text, problem):
    path = tmp_path / "r.geojson"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(RegionError) as raised:
        read_regions(path, "s")
    message = str(raised.value)
    assert message.startswith(f"slide 's' ({path}): ") and problem in message, message
    assert "\n" not in message


@pytest.mark.slow  # a million vertices
def test_a_polygon_of_a_million_vertices_is_rasterised_in_linear_time(
    rect_slide, rect_mask, tmp_path
):
    # A 4 x 4-tile square whose edges carry a million vertices: the same tiles as its corners.
    x0, y0, x1, y1 = 6 * T, 5 * T, 10 * T, 9 * T
    n = 250_000
    t = np.linspace(0, 1, n, endpoint=False)
    ring = np.concatenate([
        np.c_[x0 + t * (x1 - x0), np.full(n, y0)], np.c_[np.full(n, x1), y0 + t * (y1 - y0)],
        np.c_[x1 - t * (x1 - x0), np.full(n, y1)], np.c_[np.full(n, x0), y1 - t * (y1 - y0)],
    ])  # fmt: skip
    roi = tmp_path / "big.geojson"
    geometry = {"type": "Polygon", "coordinates": [ring.tolist()]}
    roi.write_text(json.dumps({"type": "Feature", "geometry": geometry}))
    assert roi.stat().st_size > 20e6
    started = time.monotonic()
    tiles = tile_with(rect_slide, rect_mask, tmp_path, roi=roi)
    assert time.monotonic() - started < 30  # was 68 s with a per-row polygon fill
    kept = set(zip(tiles["x"] // T, tiles["y"] // T, strict=True))
    assert kept == {(c, r) for c in range(6, 10) for r in range(5, 9)}


def test_a_region_too_complex_to_rasterise_fails_its_slide(rect_slide, rect_mask, tmp_path):
    # A zigzag whose every edge crosses every row of the mask.
    n = 200_000
    xs = np.linspace(RECT_TISSUE.x0, RECT_TISSUE.x1, n)
    ys = np.where(np.arange(n) % 2, 0, 16 * T)
    roi = tmp_path / "zigzag.geojson"
    ring = np.c_[xs, ys].tolist()
    geometry = {"type": "Polygon", "coordinates": [ring]}
    roi.write_text(json.dumps({"type": "Feature", "geometry": geometry}))
    started = time.monotonic()
    with pytest.raises(RegionError, match="a region is too complex to rasterise on the mask"):
        tile_with(rect_slide, rect_mask, tmp_path, roi=roi)
    assert time.monotonic() - started < 30
    assert not (tmp_path / "tiles.parquet").exists()


# --- coordinates: links, declared sizes, types, numbers --------------------------------


def h5_coords(path: Path, values=None, **attrs) -> Path:
    with h5py.File(path, "w") as f:
        dataset = f.create_dataset("coords", data=np.asarray(values if values is not None
                                                             else [[0, 0]]))  # fmt: skip
        dataset.attrs.update(attrs)
    return path


def coords_problem(rect_slide, rect_mask, tmp_path, path: Path) -> str:
    with pytest.raises(CoordsError) as raised:
        tile_with(rect_slide, rect_mask, tmp_path, coords=path)
    message = str(raised.value)
    assert message.startswith(f"slide 'rect' ({path}): ") and "\n" not in message, message
    assert not (tmp_path / "tiles.parquet").exists()
    return message


def test_an_external_link_to_a_fifo_is_refused_without_opening_it(rect_slide, rect_mask, tmp_path):
    os.mkfifo(tmp_path / "pipe.h5")
    path = tmp_path / "linked.h5"
    with h5py.File(path, "w") as f:
        f["coords"] = h5py.ExternalLink(str(tmp_path / "pipe.h5"), "/coords")
    started = time.monotonic()
    message = coords_problem(rect_slide, rect_mask, tmp_path, path)
    assert "'coords' is a ExternalLink, not a dataset of the file" in message
    assert time.monotonic() - started < 5


def test_a_virtual_or_external_dataset_is_refused(rect_slide, rect_mask, tmp_path):
    source = h5_coords(tmp_path / "source.h5", [[0, 0], [T, 0]])
    path = tmp_path / "virtual.h5"
    layout = h5py.VirtualLayout(shape=(2, 2), dtype="i8")
    layout[:] = h5py.VirtualSource(str(source), "coords", shape=(2, 2))
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("coords", layout)
    message = coords_problem(rect_slide, rect_mask, tmp_path, path)
    assert "keeps its data in other files" in message
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.zeros((2, 2), "<i8").tobytes())
    external = tmp_path / "external.h5"
    with h5py.File(external, "w") as f:
        f.create_dataset("coords", shape=(2, 2), dtype="<i8", external=[(str(raw), 0, 32)])
    assert "keeps its data in other files" in coords_problem(
        rect_slide, rect_mask, tmp_path, external
    )


def test_a_small_file_declaring_millions_of_tiles_is_refused_before_reading_them(
    rect_slide, rect_mask, tmp_path
):
    path = tmp_path / "bomb.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("coords", shape=(200_000_000, 2), dtype="i8", chunks=(1 << 20, 2),
                         compression="gzip", fillvalue=0)  # fmt: skip
    assert path.stat().st_size < 10_000
    code = f"""
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords
from slidesnake.tiling.imported import CoordsError
m = {str(rect_mask)!r}
try:
    make_tile_coords({str(rect_slide)!r}, "rect", m + "/mask.png", m + "/qc.png",
                     {str(tmp_path / "t.parquet")!r}, {str(tmp_path / "q.png")!r},
                     TileParams(), coords_path={str(path)!r})
except CoordsError as err:
    print(err)
"""
    result, wall, peak_mb = measured(code)
    assert "it declares 200,000,000 tiles, more than this slide can hold" in result.stdout
    assert wall < 20 and peak_mb < 1000, (wall, peak_mb)  # the tile rule declares 1000 MB


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.with_suffix(".csv").write_text(""), "the CSV is empty"),
        (lambda p: p.with_suffix(".csv").write_text("x,y\n=cmd|' /C calc'!A0,3\n"),
         "coordinates of type object, not numbers"),
        (lambda p: p.with_suffix(".csv").write_text("x,y\nTrue,False\n"),
         "coordinates of type bool, not numbers"),
        (lambda p: p.with_suffix(".csv").write_text("a,b\n1,2\n"), "cannot be read"),
        (lambda p: p.with_suffix(".csv").write_text(f"x,y\n{2**63 - 10},0\n"),
         "not whole level-0 pixels within the slide's reach"),
        (lambda p: p.with_suffix(".csv").write_text("x,y\n1e300,0\n"),
         "not whole level-0 pixels within the slide's reach"),
        (lambda p: pd.DataFrame({"x": ["a"], "y": ["b"]}).to_parquet(p.with_suffix(".parquet")),
         "coordinates of type object, not numbers"),
        (lambda p: h5_coords(p.with_suffix(".h5"), np.zeros(2, [("x", "i8"), ("y", "i8")])),
         "coordinates of shape (2,), not (N, 2)"),
        (lambda p: h5_coords(p.with_suffix(".h5"), patch_level=-1, patch_size=224),
         "attribute patch_level is -1, not a whole number >= 0"),
        (lambda p: h5_coords(p.with_suffix(".h5"), patch_level=7, patch_size=224),
         "attribute patch_level 7 names no level of the slide (3 levels)"),
        (lambda p: h5_coords(p.with_suffix(".h5"), patch_size_level0="448"),
         "attribute patch_size_level0 is"),
        (lambda p: h5_coords(p.with_suffix(".h5"), patch_size_level0=[448, 448]),
         "attribute patch_size_level0 is"),
        (lambda p: h5_coords(p.with_suffix(".h5"), patch_size_level0=np.nan),
         "attribute patch_size_level0 is nan, not a whole number >= 1"),
        (lambda p: h5_coords(p.with_suffix(".h5"), np.array([[b"1", b"2"]])),
         "coordinates of type |S1, not numbers"),
    ],
)  # fmt: skip
def test_a_malformed_coordinates_file_is_one_line_naming_it(
    rect_slide, rect_mask, tmp_path, make, problem
):
    make(tmp_path / "coords")
    (path,) = tmp_path.glob("coords.*")
    message = coords_problem(rect_slide, rect_mask, tmp_path, path)
    assert problem in message, message


def test_coordinates_near_the_int64_limit_do_not_overflow_the_bounds_check(
    rect_slide, rect_mask, tmp_path
):
    path = tmp_path / "c.h5"
    h5_coords(path, np.array([[2**40, 0], [T, T]], np.int64))
    assert "1 of 2 tiles lie outside the slide" in coords_problem(
        rect_slide, rect_mask, tmp_path, path
    )


# --- the cohort: a hostile side file fails its slide alone; a replaced one is redone ---


@pytest.mark.workflow
def test_hostile_side_files_fail_their_slides_alone_and_replaced_ones_are_redone(
    workflow, tmp_path
):
    from conftest import jobs_run

    from slidesnake import load_embeddings
    from slidesnake.slides.synthetic import Rect, write_slide

    slide = write_slide(tmp_path / "s.svs", 2048, 2048, [Rect(448, 448, 1792, 1792)], mpp=0.5)
    bad_roi = tmp_path / "bad.geojson"
    bad_roi.write_text('{"type": "FeatureCollection", "features": 5}')
    bomb = tmp_path / "bomb.h5"
    with h5py.File(bomb, "w") as f:
        f.create_dataset("coords", shape=(200_000_000, 2), dtype="i8", chunks=(1 << 20, 2),
                         compression="gzip")  # fmt: skip
    coords = tmp_path / "coords.csv"
    coords.write_text("x,y\n448,448\n672,448\n896,448\n")
    rows = [("fine", "", ""), ("badroi", bad_roi, ""), ("bomb", "", bomb), ("csv", "", coords)]
    (workflow.dir / "config" / "samples.tsv").write_text(
        "slide_id\tpath\troi\tcoords\n"
        + "".join(f"{i}\t{slide}\t{roi}\t{c}\n" for i, roi, c in rows)
    )
    result = workflow.run(check=False)
    assert result.returncode != 0
    table = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t").set_index("slide_id")
    assert dict(table["status"]) == {"fine": "done", "badroi": "failed", "bomb": "failed",
                                     "csv": "done"}  # fmt: skip
    assert table.loc["badroi", "reason"].startswith(f"slide 'badroi' ({bad_roi}): ")
    assert "it is not GeoJSON of features" in table.loc["badroi", "reason"]
    assert "declares 200,000,000 tiles" in table.loc["bomb", "reason"]
    for failed in ("badroi", "bomb"):
        assert not workflow.result(failed, "tiles.parquet").exists()
    assert table.loc["csv", "tiles"] == 3
    # A different file with an older modification time (cp -p, a restore) is redone.
    coords.write_text("x,y\n448,448\n")
    os.utime(coords, (1e9, 1e9))
    rerun = workflow.run(check=False)
    assert jobs_run(rerun, "make_tile_coords") == ["badroi", "bomb", "csv"]
    assert len(load_embeddings(workflow.result("csv", "embeddings.zarr"))[1]) == 1
