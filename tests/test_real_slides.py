"""Real scans and real broken files from ../shared/slides (skipped when it is absent)."""

import numpy as np
import openslide
import pytest

from slidesnake.errors import MppError
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams, saturation

pytestmark = pytest.mark.real_slides

# slide id -> (file under ../shared/slides, words its one-line failure must contain)
BAD = {
    "broken-text": ("broken/histolab-broken.svs", "does not recognise"),
    "broken-unopenable": ("broken/openslide-unopenable.tiff", "Unsupported TIFF compression"),
    "broken-unreadable": ("broken/openslide-unreadable.svs", "could not be decoded"),
    "boxes-72dpi": ("openslide-boxes.tiff", "352.8 µm/px"),
    "tcga-no-mpp": ("tcga-cr-7395-01a-01-ts1.svs", "does not record its microns per pixel"),
    "dicom-jpegls": ("unsupported/highdicom-sm_image_jpegls.dcm", "Unsupported transfer syntax"),
    "dicom-16bit": ("unsupported/highdicom-sm_image_grayscale.dcm", "BitsAllocated"),
    "dicom-no-flavor": ("unsupported/pathml-small_dicom.dcm", "image flavor"),
    "kidney-stripped": ("unsupported/histolab-kidney-48-5.tif", "does not recognise"),
    "vectra-qptiff": ("unsupported/pathml-small_vectra.qptiff", "does not recognise"),
}
GOOD = {
    "cmu": ("CMU-1-Small-Region.svs", ""),
    "tcga": ("tcga-cr-7395-01a-01-ts1.svs", 0.5),  # J2K, rescued by the sheet's mpp
    "small": ("openslide-small.svs", ""),
    "dicom-boxes": ("dicom-openslide-boxes/boxes_0.dcm", ""),
}


def tissue_share(pixels: np.ndarray) -> float:
    return float((saturation(pixels) > 0.15).mean())


def test_cmu_tiles_cover_its_tissue_and_none_of_its_glass(shared_slides, tmp_path):
    path = shared_slides / "CMU-1-Small-Region.svs"
    make_tissue_mask(path, "cmu", tmp_path / "m.png", tmp_path / "qc.png", TissueParams())
    make_tile_coords(
        path,
        "cmu",
        tmp_path / "m.png",
        tmp_path / "qc.png",
        tmp_path / "t.parquet",
        tmp_path / "qct.png",
        TileParams(),
    )
    tiles, geometry = read_tiles(tmp_path / "t.parquet")
    kept = set(zip(tiles["x"], tiles["y"], strict=True))
    size, step = geometry.size_level0, geometry.stride_level0
    osr = openslide.OpenSlide(path)
    glass, tissue = set(), set()
    for y in range(0, 2967 - size + 1, step):
        for x in range(0, 2220 - size + 1, step):
            share = tissue_share(np.asarray(osr.read_region((x, y), 0, (size, size)))[..., :3])
            if share < 0.02:
                glass.add((x, y))
            elif share > 0.8:
                tissue.add((x, y))
    assert len(glass) > 20 and len(tissue) > 10  # the slide has both
    assert not kept & glass
    assert tissue <= kept
    assert 0.2 < len(kept) / (len(range(0, 2967 - size + 1, step)) * 9) < 0.6


def test_tcga_without_mpp_fails_and_succeeds_with_it(shared_slides, tmp_path):
    path = shared_slides / "tcga-cr-7395-01a-01-ts1.svs"
    with pytest.raises(MppError, match="'mpp' column"):
        make_tissue_mask(path, "tcga", tmp_path / "m.png", tmp_path / "qc.png", TissueParams())
    mask = make_tissue_mask(
        path, "tcga", tmp_path / "m.png", tmp_path / "qc.png", TissueParams(), sheet_mpp=0.5
    )
    assert mask.read_level == 1 and 0.2 < mask.tissue_fraction < 0.9


@pytest.mark.workflow
def test_each_bad_slide_fails_its_own_job_and_good_slides_finish(shared_slides, workflow):
    rows = [(sid, shared_slides / f, mpp) for sid, (f, mpp) in GOOD.items()]
    rows += [(sid, shared_slides / f) for sid, (f, _) in BAD.items()]
    workflow.sheet(rows)
    result = workflow.run(check=False)
    assert result.returncode != 0
    for slide_id in GOOD:
        assert workflow.result(slide_id, "tiles.parquet").exists(), slide_id
    assert len(read_tiles(workflow.result("cmu", "tiles.parquet"))[0]) > 20
    assert len(read_tiles(workflow.result("tcga", "tiles.parquet"))[0]) > 20
    assert read_tiles(workflow.result("small", "tiles.parquet"))[0].empty  # 16 px: no tile fits
    for slide_id, (file, reason) in BAD.items():
        assert not (workflow.dir / "results" / "slides" / slide_id).exists() or not any(
            (workflow.dir / "results" / "slides" / slide_id).iterdir()
        ), slide_id
        error_lines = [
            line
            for line in workflow.log(slide_id, "make_tissue_mask").splitlines()
            if " ERROR " in line
        ]
        assert len(error_lines) == 1, slide_id
        assert f"slide '{slide_id}' ({shared_slides / file})" in error_lines[0]
        assert reason in error_lines[0] and "Fix:" in error_lines[0]
        assert error_lines[0].split(" ERROR slidesnake: ")[1] in result.stderr
