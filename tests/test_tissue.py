import numpy as np

from slidesnake.tiling.tissue import TissueParams, detect_tissue

MPP = 8.0
PINK = (225, 150, 190)


def white(h=200, w=300, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(242, 3, (h, w, 3)), 0, 255).astype(np.uint8)


def test_white_background_is_not_tissue():
    assert not detect_tissue(white(), MPP, TissueParams()).any()


def test_faint_smudges_and_small_specks_are_not_tissue():
    img = white()
    img[20:80, 20:120] = (236, 228, 232)  # a large, faint, barely coloured smudge
    img[150:153, 200:203] = PINK  # a 24 µm speck of dust or debris
    img[100:104, 250:254] = (60, 40, 90)
    assert not detect_tissue(img, MPP, TissueParams()).any()


def test_tissue_is_found_and_small_holes_filled():
    img = white()
    img[50:150, 60:240] = PINK
    img[90:93, 100:103] = 242  # 24 µm hole: filled
    img[60:90, 180:230] = 242  # 240 x 400 µm lumen: kept as a hole
    mask = detect_tissue(img, MPP, TissueParams())
    assert mask[91, 101]
    assert not mask[75, 205]
    tissue_px = 100 * 180 - 30 * 50
    assert abs(int(mask.sum()) - tissue_px) < 0.03 * tissue_px
    assert not mask[:40].any() and not mask[160:].any()


def test_min_object_size_is_in_square_microns():
    img = white()
    img[10:20, 10:20] = PINK  # 10 x 10 px = 6400 µm² at 8 µm/px
    assert not detect_tissue(img, MPP, TissueParams(min_object_um2=10_000)).any()
    assert detect_tissue(img, MPP, TissueParams(min_object_um2=1_000, blur_um=8)).any()


def test_empty_picture_gives_empty_mask():
    assert detect_tissue(np.zeros((0, 0, 3), np.uint8), MPP, TissueParams()).shape == (0, 0)
