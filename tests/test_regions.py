"""Regions of interest from GeoJSON: exact tile counts on the rect slide, holes, excluded
classes, MultiPolygons, bad files, the real CMU slide, and the workflow's re-runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import RECT_TISSUE, jobs_run

from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.regions import RegionError, read_regions
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams

T = 448  # level-0 px of a 224 px tile at 0.5 µm/px on the 0.25 µm/px rect slide


def square(x0: int, y0: int, x1: int, y1: int) -> list[list[int]]:
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


def polygon(x0: int, y0: int, x1: int, y1: int) -> dict:
    return feature("Polygon", [square(x0, y0, x1, y1)])


def feature(geometry_type: str, coordinates, name: str | None = None) -> dict:
    properties = {"classification": {"name": name}} if name else {}
    return {"type": "Feature", "geometry": {"type": geometry_type, "coordinates": coordinates},
            "properties": properties}  # fmt: skip


def write_geojson(path: Path, *features: dict) -> Path:
    path.write_text(json.dumps({"type": "FeatureCollection", "features": list(features)}))
    return path


@pytest.fixture(scope="module")
def rect_mask(tmp_path_factory, rect_slide) -> Path:
    out = tmp_path_factory.mktemp("rect-regions")
    make_tissue_mask(rect_slide, "rect", out / "mask.png", out / "qc.png", TissueParams())
    return out


def tiles_in(rect_slide, rect_mask: Path, tmp_path: Path, geojson: Path, **classes) -> set:
    regions = read_regions(geojson, "rect", **classes)
    make_tile_coords(
        rect_slide, "rect", rect_mask / "mask.png", rect_mask / "qc.png",
        tmp_path / "tiles.parquet", tmp_path / "qc_tiles.png", TileParams(), regions, geojson,
    )  # fmt: skip
    tiles, _ = read_tiles(tmp_path / "tiles.parquet")
    return set(zip(tiles["x"] // T, tiles["y"] // T, strict=True))


def grid(cols: range, rows: range) -> set:
    return {(c, r) for c in cols for r in rows}


def test_a_square_region_keeps_exactly_its_tiles(rect_slide, rect_mask, tmp_path):
    roi = write_geojson(tmp_path / "roi.geojson", polygon(6 * T, 5 * T, 10 * T, 9 * T))
    assert tiles_in(rect_slide, rect_mask, tmp_path, roi) == grid(range(6, 10), range(5, 9))


def test_a_hole_and_an_excluded_class_remove_their_tiles(rect_slide, rect_mask, tmp_path):
    outer, hole = square(6 * T, 5 * T, 10 * T, 9 * T), square(7 * T, 6 * T, 9 * T, 8 * T)
    expected = grid(range(6, 10), range(5, 9)) - grid(range(7, 9), range(6, 8))
    with_hole = write_geojson(tmp_path / "hole.geojson", feature("Polygon", [outer, hole]))
    assert tiles_in(rect_slide, rect_mask, tmp_path, with_hole) == expected
    excluded = write_geojson(
        tmp_path / "excluded.geojson",
        feature("Polygon", [outer], "Tumor"),
        feature("Polygon", [hole], "Necrosis"),
    )
    assert tiles_in(rect_slide, rect_mask, tmp_path, excluded, exclude=["Necrosis"]) == expected
    only = tiles_in(rect_slide, rect_mask, tmp_path, excluded, include=["Necrosis"])
    assert only == grid(range(7, 9), range(6, 8))


def test_a_multipolygon_keeps_the_tiles_of_each_part(rect_slide, rect_mask, tmp_path):
    parts = [[square(5 * T, 4 * T, 7 * T, 6 * T)], [square(12 * T, 9 * T, 15 * T, 12 * T)]]
    roi = write_geojson(tmp_path / "multi.geojson", feature("MultiPolygon", parts))
    expected = grid(range(5, 7), range(4, 6)) | grid(range(12, 15), range(9, 12))
    assert tiles_in(rect_slide, rect_mask, tmp_path, roi) == expected


def test_a_region_beyond_the_tissue_keeps_only_tissue(rect_slide, rect_mask, tmp_path):
    tissue = RECT_TISSUE  # x 5-15, y 4-12 tiles
    roi = write_geojson(tmp_path / "big.geojson", polygon(0, 0, 13 * T, 20 * T))
    kept = tiles_in(rect_slide, rect_mask, tmp_path, roi)
    columns = range(int(tissue.x0) // T, 13)
    assert kept == grid(columns, range(int(tissue.y0) // T, int(tissue.y1) // T))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "cannot be read as GeoJSON"),
        ('{"type": "FeatureCollection", "features": []}', "no Polygon or MultiPolygon region"),
        (json.dumps(feature("Point", [10, 10])), "no Polygon or MultiPolygon region"),
        (json.dumps(feature("Polygon", [square(10**7, 10**7, 10**7 + 900, 10**7 + 900)])),
         "the regions cover none of the slide"),
    ],
)  # fmt: skip
def test_bad_region_files_fail_the_slide_with_its_line(
    rect_slide, rect_mask, tmp_path, text, message
):
    roi = tmp_path / "bad.geojson"
    roi.write_text(text)
    with pytest.raises(RegionError, match=message) as error:
        tiles_in(rect_slide, rect_mask, tmp_path, roi)
    assert str(error.value).startswith(f"slide 'rect' ({roi}): ") and "Fix: " in str(error.value)
    assert not (tmp_path / "tiles.parquet").exists()


def test_a_region_over_half_the_real_tissue_keeps_about_half_the_tiles(tmp_path, shared_slides):
    slide = shared_slides / "CMU-1-Small-Region.svs"
    make_tissue_mask(slide, "cmu", tmp_path / "mask.png", tmp_path / "qc.png", TissueParams())
    args = (slide, "cmu", tmp_path / "mask.png", tmp_path / "qc.png")
    make_tile_coords(*args, tmp_path / "all.parquet", tmp_path / "all.png", TileParams())
    every, geometry = read_tiles(tmp_path / "all.parquet")
    middle = int(every["y"].median()) + geometry.size_level0 // 2
    roi = write_geojson(tmp_path / "top.geojson", feature("Polygon", [square(0, 0, 2220, middle)]))
    regions = read_regions(roi, "cmu")
    make_tile_coords(*args, tmp_path / "top.parquet", tmp_path / "top.png", TileParams(),
                     regions, roi)  # fmt: skip
    top, _ = read_tiles(tmp_path / "top.parquet")
    assert 0.35 * len(every) < len(top) < 0.65 * len(every)
    assert (top["y"] + geometry.size_level0 <= middle + geometry.size_level0 // 2).all()


@pytest.mark.workflow
def test_regions_in_the_sheet_rerun_only_their_slide_and_a_bad_one_fails_alone(
    workflow, rect_slide, tmp_path
):
    roi = write_geojson(tmp_path / "roi.geojson", polygon(6 * T, 5 * T, 10 * T, 9 * T))
    broken = tmp_path / "broken.geojson"
    broken.write_text("{not json")
    sheet = workflow.dir / "config" / "samples.tsv"
    sheet.write_text(
        "slide_id\tpath\troi\n"
        f"whole\t{rect_slide}\t\n"
        f"roi\t{rect_slide}\t{roi}\n"
        f"broken\t{rect_slide}\t{broken}\n"
    )
    first = workflow.run(check=False)
    assert first.returncode != 0
    assert len(read_tiles(workflow.result("whole", "tiles.parquet"))[0]) == 80
    assert len(read_tiles(workflow.result("roi", "tiles.parquet"))[0]) == 16
    assert "slide 'broken'" in workflow.log("broken", "make_tile_coords")
    assert workflow.result("roi", "embeddings.zarr").is_dir()

    sheet.write_text(sheet.read_text().replace(f"broken\t{rect_slide}\t{broken}\n", ""))
    time.sleep(1)
    write_geojson(roi, feature("Polygon", [square(6 * T, 5 * T, 8 * T, 9 * T)]))
    second = workflow.run()
    assert jobs_run(second, "make_tile_coords") == ["roi"]
    assert jobs_run(second, "embed_tiles") == ["roi"]
    assert len(read_tiles(workflow.result("roi", "tiles.parquet"))[0]) == 8
