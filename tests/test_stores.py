"""Slides read in place from real stores on loopback (moto's S3 server, a Range-capable
HTTP server): the same pixels, tiles and embeddings as the same slide read from disk, the
bytes and requests it costs, and each store failure failing its own slide in one line."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from conftest import SHARED_SLIDES, jobs_run
from store_servers import FLAKY, SECRET

from slidesnake import load_embeddings
from slidesnake.errors import SlideOpenError, SlideReadError
from slidesnake.loader.batches import TileBatches
from slidesnake.slides import locator, stores
from slidesnake.slides.byte_ranges import merge_ranges
from slidesnake.slides.slide import Slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams

pytestmark = pytest.mark.store


@pytest.fixture(autouse=True)
def storage(request):
    """Each test reads with its store's settings, and retries quickly."""
    section = {"retries": 2}
    if "s3" in request.fixturenames:
        section |= request.getfixturevalue("s3").storage
    stores.configure(section)
    yield
    stores.configure(None)


def test_a_url_is_shown_without_credentials_or_query():
    url = "https://user:pa55@host.example/a/b.svs?X-Amz-Signature=abc"
    assert stores.location(url) == "https://host.example/a/b.svs…"
    for hidden in (
        "https://host.example/a/b.svs#token=abc",
        "https://host.example/a/b.svs;jsessionid=abc",
        "https://host.example/a;sid=abc/b.svs",
        "https://abc@host.example/a/b.svs?",
    ):
        assert stores.location(hidden).startswith("https://host.example/a")
        assert "abc" not in stores.location(hidden) and stores.location(hidden).endswith("…")
    assert stores.location("s3://bucket/key.svs") == "s3://bucket/key.svs"
    assert stores.location("slides/a.svs") == "slides/a.svs"
    assert not stores.is_url("slides/a.svs") and stores.is_url("gs://b/k.svs")


def test_neighbouring_ranges_are_merged_and_distant_ones_kept_apart():
    ranges = [(0, 100), (100, 250), (300, 400), (10_000, 10_100)]
    spans = merge_ranges(ranges, gap=32)
    assert [(s, e) for s, e, _ in spans] == [(0, 250), (300, 400), (10_000, 10_100)]
    assert spans[0][2] == [(0, 100), (100, 250)]
    capped = merge_ranges([(0, 100), (100, 200), (200, 300)], gap=0, max_span=200)
    assert [(s, e) for s, e, _ in capped] == [(0, 200), (200, 300)]


def _same_slide(local: Slide, remote: Slide) -> None:
    assert remote.levels == local.levels
    assert (remote.mpp, remote.vendor) == (local.mpp, local.vendor)
    for level in local.levels:
        w, h = min(level.width, 900), min(level.height, 700)
        x, y = int(level.downsample) * 3, int(level.downsample) * 5
        assert np.array_equal(
            remote.read(level.index, x, y, w, h), local.read(level.index, x, y, w, h)
        )


def test_a_slide_in_s3_is_the_same_slide_as_on_disk(s3, rect_slide, blob_slide):
    for path in (rect_slide, blob_slide):
        url = s3.put("cohort", f"synthetic/{path.name}", path)
        with Slide(path, "s") as local, Slide(url, "s") as remote:
            assert remote.in_place and str(remote.path) == url
            _same_slide(local, remote)


@pytest.mark.real_slides
def test_real_slides_in_s3_are_the_same_slides_as_on_disk(s3, shared_slides):
    for name, mpp in [("CMU-1-Small-Region.svs", None), ("tcga-cr-7395-01a-01-ts1.svs", 0.5)]:
        url = s3.put("cohort", f"real/{name}", shared_slides / name)
        with Slide(shared_slides / name, "s", mpp) as local, Slide(url, "s", mpp) as remote:
            _same_slide(local, remote)


def _tiles(path, out, slide_id="s", mpp=None):
    out.mkdir(parents=True, exist_ok=True)
    make_tissue_mask(
        slide_path=path, slide_id=slide_id, mask_path=out / "mask.png", qc_path=out / "qc.png",
        params=TissueParams(), sheet_mpp=mpp,
    )  # fmt: skip
    make_tile_coords(
        slide_path=path, slide_id=slide_id, mask_path=out / "mask.png",
        mask_qc_path=out / "qc.png", tiles_path=out / "tiles.parquet",
        qc_path=out / "qc_tiles.png", params=TileParams(),
    )  # fmt: skip
    return out


def _all_tiles(path, tiles_path, workers=2):
    tiles, geometry = read_tiles(tiles_path)
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    stream = TileBatches(path, "s", coords, geometry, 16).stream(workers, prefetch=2)
    got = np.empty((len(coords), *stream.ring.tiles.shape[-3:]), np.uint8)
    for rows, pixels in stream:
        got[rows] = pixels
    return got, stream.reads()


def test_masks_tiles_and_loader_batches_from_s3_equal_those_from_disk(s3, tmp_path, rect_slide):
    url = s3.put("cohort", "rect.svs", rect_slide)
    local, remote = _tiles(rect_slide, tmp_path / "local"), _tiles(url, tmp_path / "s3")
    for name in ("mask.png", "tiles.parquet"):
        assert (local / name).read_bytes() == (remote / name).read_bytes(), name
    from_disk, _ = _all_tiles(rect_slide, local / "tiles.parquet")
    from_s3, reads = _all_tiles(url, remote / "tiles.parquet")
    assert np.array_equal(from_disk, from_s3)
    assert reads["requests"] < 0.75 * len(from_s3)  # 80 tiles: the index is a third of it


@pytest.mark.real_slides
def test_the_cmu_slide_from_s3_costs_its_tiles_bytes_and_few_requests(s3, tmp_path, shared_slides):
    """Bytes read ≤ 1.2 x (the compressed tiles the embedded tiles need + the index), and
    well under one request per tile: ranges are merged."""
    path = shared_slides / "CMU-1-Small-Region.svs"
    url = s3.put("cohort", "cmu.svs", path)
    tiles = _tiles(url, tmp_path / "s3") / "tiles.parquet"
    got, reads = _all_tiles(url, tiles)
    table, geometry = read_tiles(tiles)
    with Slide(url, "s") as slide:
        index_bytes, _ = slide.io_counts()
        level = slide.tiled_level(geometry.read_level)
        size = round(geometry.size_level0 / geometry.read_downsample)
        needed = {key for x, y in table[["x", "y"]].to_numpy().tolist()
                  for key in level.cut(x, y, size, size).tiles()}  # fmt: skip
        tile_bytes = sum(level._page.databytecounts[r * level.across + c] for r, c in needed)
    assert reads["bytes_read"] <= 1.2 * (tile_bytes + index_bytes)
    assert reads["requests"] / len(got) < 0.5  # 18 for 42 tiles here, 5 of them the index
    assert reads["compressed_tiles_decoded"] == len(needed)


def test_a_slide_over_http_reads_as_on_disk_and_survives_dropped_connections(web, rect_slide):
    url = web.add(rect_slide, "flaky/rect.svs")
    before = web.requests
    with Slide(rect_slide, "s") as local, Slide(url, "s") as remote:
        _same_slide(local, remote)
    assert web.requests - before > FLAKY  # the dropped ones were asked again


def _fails(url, error, *words):
    with pytest.raises(error) as caught:
        Slide(url, "bad-slide").read(0, 0, 0, 512, 512)
    message = str(caught.value)
    assert "slide 'bad-slide'" in message and stores.location(url) in message
    for word in words:
        assert word in message, message
    assert SECRET not in message and "pa55" not in message and "Fix:" in message


def test_each_store_failure_fails_its_slide_in_one_line(s3, web, rect_slide, tmp_path):
    _fails("s3://cohort/no-such-slide.svs", SlideOpenError, "no such object")
    _fails(web.add(rect_slide, "forbidden/rect.svs"), SlideOpenError, "refused access", "403")
    _fails(web.add(rect_slide, "dropping/rect.svs"), SlideReadError, "failed 3 times")
    _fails(web.add(rect_slide, "norange/rect.svs"), SlideReadError, "not honour Range")
    _fails("s3://cohort/case.mrxs", SlideOpenError, "MIRAX", "local")
    _fails(s3.put("cohort", "notes.svs", b"not a slide at all" * 100), SlideOpenError, "in place")
    whole = rect_slide.read_bytes()
    truncated = s3.put("cohort", "truncated.svs", whole[: len(whole) * 2 // 3])
    _fails(truncated, SlideOpenError, "truncated")
    user_url = web.url.replace("http://", "http://user:pa55@") + "/dropping/rect.svs"
    _fails(user_url, SlideReadError, "failed")
    if importlib.util.find_spec("gcsfs") is None:  # an optional dependency
        _fails("gs://cohort/a.svs", SlideOpenError, "slidesnake[gcs]")


def test_a_format_only_openslide_reads_fails_before_any_request(tmp_path):
    with pytest.raises(SlideOpenError, match="Hamamatsu NDPI slides are read by OpenSlide only"):
        Slide("https://127.0.0.1:9/never/asked.ndpi", "s")


def test_sizes_and_versions_of_a_sheet_come_from_one_concurrent_round(s3, web, rect_slide):
    urls = [s3.put("cohort", f"many/{i}.svs", rect_slide) for i in range(5)]
    served = web.add(rect_slide, "plain/rect.svs")
    found = locator.stat_slides([*urls, served, "local/path.svs", "s3://cohort/missing.svs"])
    assert set(found) == {*urls, served, "s3://cohort/missing.svs"}
    size = rect_slide.stat().st_size
    assert all(found[u].startswith(f"{size} bytes, ETag") for u in [*urls, served])
    assert found["s3://cohort/missing.svs"].startswith("unreadable (the store has no such object")
    s3.put("cohort", "many/0.svs", b"changed bytes")
    assert locator.stat_slides(urls[:1])[urls[0]] != found[urls[0]]


@pytest.mark.workflow
def test_a_cohort_in_s3_runs_as_on_disk_reruns_only_changed_objects_and_writes_no_secret(
    s3, workflow, rect_slide, blob_slide
):
    rows = [("on_disk", rect_slide), ("in_s3", s3.put("cohort", "wf/rect.svs", rect_slide))]
    if SHARED_SLIDES.is_dir():
        cmu = SHARED_SLIDES / "CMU-1-Small-Region.svs"
        rows += [("cmu_disk", cmu), ("cmu_s3", s3.put("cohort", "wf/cmu.svs", cmu))]
    workflow.sheet(rows)
    storage = f"storage={{s3: {{endpoint_url: {s3.url}}}}}"
    first = workflow.run("--config", storage, "--resources", "storage_io=1")
    assert jobs_run(first, "embed_tiles") == sorted(r[0] for r in rows)
    for disk, remote in zip(*[iter(r[0] for r in rows)] * 2, strict=True):
        for name in ("tissue_mask.png", "tiles.parquet"):
            assert (
                workflow.result(disk, name).read_bytes()
                == workflow.result(remote, name).read_bytes()
            )
        local, _, _ = load_embeddings(workflow.result(disk, "embeddings.zarr"))
        features, _, attrs = load_embeddings(workflow.result(remote, "embeddings.zarr"))
        np.testing.assert_array_equal(features, local)
        assert attrs["slide_path"].startswith("s3://cohort/wf/") and attrs["slide_version"]
        metrics = json.loads(workflow.result(remote, "metrics.json").read_text())
        assert metrics["bytes_read"] > 0 and 0 < metrics["requests"] < metrics["tiles"]
    assert "Nothing to be done" in workflow.run("--config", storage).stderr

    s3.put("cohort", "wf/rect.svs", blob_slide)  # the same key, other bytes
    changed = workflow.run("--config", storage)
    assert jobs_run(changed, "make_tissue_mask") == ["in_s3"]
    written = [p for p in workflow.dir.rglob("*") if p.is_file()]
    assert written and not [p for p in written if SECRET.encode() in p.read_bytes()]
