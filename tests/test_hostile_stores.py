"""Slides in stores against a hostile or careless server: an object replaced while it is
read, answers longer than the range asked (an encoding that inflates, a body without end,
a length that lies), servers that drip, never answer a HEAD or never answer at all, and
a TIFF whose tiles all share one JPEG. Each fails its own slide with one line, within a
bound the test checks (wall time, and peak memory of the process that read), and nothing
that looks finished is written.

The servers are real, on loopback: moto's S3 server, and the Range server of
store_servers with its hostile modes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import tifffile
from conftest import RECT_TISSUE, REPO, embed_one
from store_servers import SilentServer

from slidesnake.embed.settings import EmbedSettings
from slidesnake.errors import SlideReadError, StoreTimeoutError
from slidesnake.loader.batches import TileBatches
from slidesnake.slides import locator, stores
from slidesnake.slides.slide import Slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams

pytestmark = pytest.mark.store

# Short deadlines, so that a test of a silent server ends in seconds.
QUICK = {"connect_timeout_s": 1, "read_timeout_s": 2, "request_timeout_s": 2, "retries": 1}
# What a reading process may take, at most, whatever a server sends: the interpreter, its
# imports and a read take some 100 MB here; a body read whole would take gigabytes.
PEAK_MB = 400


@pytest.fixture(autouse=True)
def storage(request):
    section = dict(QUICK)
    if "s3" in request.fixturenames:
        section |= request.getfixturevalue("s3").storage
    stores.configure(section)
    yield section
    stores.configure(None)


def _changed(data: bytes) -> bytes:
    """The same bytes but one, in the middle of the slide's tiles: another version."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def _replaced_between_reads(url: str, replace) -> SlideReadError:
    """The error of the second of two reads of one open slide, replaced between them."""
    with Slide(url, "moving") as slide:
        slide.read(0, 0, 0, 256, 256)
        replace()
        with pytest.raises(SlideReadError) as caught:  # tiles that were not read before
            slide.read(0, RECT_TISSUE.x0, RECT_TISSUE.y0, 2048, 2048)
    return caught.value


def test_an_object_replaced_between_two_reads_fails_its_slide_on_s3_and_over_http(
    s3, web, rect_slide
):
    data = rect_slide.read_bytes()
    url = s3.put("cohort", "moving/rect.svs", data)
    error = _replaced_between_reads(
        url, lambda: s3.put("cohort", "moving/rect.svs", _changed(data))
    )
    assert "changed while it was read" in str(error) and "slide 'moving'" in str(error)
    for prefix in ("plain", "pinned"):  # the answer's ETag tells; a 412 tells
        url = web.add(rect_slide, f"{prefix}/moving.svs")
        target = web.root / prefix / "moving.svs"
        error = _replaced_between_reads(url, lambda t=target: _rewrite(t, _changed(data)))
        assert "changed while it was read" in str(error), prefix
        if prefix == "pinned":
            assert "HTTP 412" in str(error)


def _rewrite(path, data: bytes) -> None:
    """Replace the file's bytes, its modification time (and so its ETag) moved on."""
    path.write_bytes(data)
    now = time.time_ns() + 10**9
    os.utime(path, ns=(now, now))


def _tiled(url: str, out) -> object:
    out.mkdir(parents=True, exist_ok=True)
    make_tissue_mask(url, "s", out / "mask.png", out / "qc.png", TissueParams(), None)
    make_tile_coords(
        url, "s", out / "mask.png", out / "qc.png", out / "tiles.parquet", out / "qc_tiles.png",
        TileParams(),
    )  # fmt: skip
    return out / "tiles.parquet"


def test_an_embedding_job_whose_slide_changes_midway_writes_nothing(web, rect_slide, tmp_path):
    url = web.add(rect_slide, "plain/midway.svs")
    tiles = _tiled(url, tmp_path / "tiles")
    settings = EmbedSettings(
        model="timm:test_vit", weights="random", precision="fp32", workers=1, batch_size=8,
        prefetch=1,
    )  # fmt: skip
    web.replace_after("plain/midway.svs", 3, _changed(rect_slide.read_bytes()))
    out = tmp_path / "out"
    with pytest.raises(SlideReadError, match="changed while it was read"):
        embed_one(url, "s", tiles, out / "e.zarr", out / "metrics.json", settings)
    assert not (out / "e.zarr").exists() and not (out / "metrics.json").exists()
    assert [p.name for p in out.rglob("*")] == []


READ_IN_CHILD = r"""
import json, re, sys, time
from slidesnake.slides import locator, stores
from slidesnake.slides.slide import Slide
stores.configure(json.loads(sys.argv[2]))
started, error = time.monotonic(), None
try:
    if sys.argv[3] == "stat":
        error = locator.stat_slides([sys.argv[1]])[sys.argv[1]]
    else:
        with Slide(sys.argv[1], "hostile") as slide:
            slide.read(0, 3000, 3000, 1024, 1024)
except Exception as err:
    error = f"{type(err).__name__}: {err}"
# VmHWM, not ru_maxrss: that one keeps the forking parent's size across exec
peak = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
print(json.dumps({"error": error, "s": time.monotonic() - started, "peak_mb": peak}))
"""


def _read_in_child(url: str, storage: dict, what: str = "read") -> dict:
    """Open and read the slide at `url` (or stat it) in a process of its own: its error,
    wall time and peak memory."""
    result = subprocess.run(
        [sys.executable, "-c", READ_IN_CHILD, url, json.dumps(storage), what],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("mode", "after", "words"),
    [
        ("gzip", 0, "encoded (gzip)"),
        ("endless", 0, "more than the"),  # the index's first block
        ("endless", 6, "more than the"),  # a tile range, once the index is read
        ("overlong", 0, "declared for a range of"),
    ],
)
def test_an_answer_longer_than_asked_fails_its_slide_in_bounded_memory(
    web, rect_slide, storage, mode, after, words
):
    name = f"turned/{mode}-{after}.svs"
    url = web.add(rect_slide, name)
    web.turn_after(name, after, mode)
    got = _read_in_child(url, storage)
    assert got["error"].startswith("SlideReadError: slide 'hostile'"), got
    assert "did not answer a byte range with that range's bytes" in got["error"]
    assert words in got["error"]
    assert got["peak_mb"] < PEAK_MB and got["s"] < 10


def test_an_endless_dicomweb_answer_at_dag_time_costs_its_slide_a_bounded_read(web, storage):
    url = f"{web.url}/endless/dicom-web/studies/1.2/series/3.4"
    got = _read_in_child(url, {**storage, "max_answer_mb": 4}, "stat")
    assert got["error"].startswith("unreadable (") and "longer than 4 MB" in got["error"]
    assert got["peak_mb"] < PEAK_MB and got["s"] < 10


def test_silent_and_slow_servers_fail_their_slide_within_the_deadlines(web, rect_slide):
    silent = SilentServer()
    try:
        urls = {
            "drip": web.add(rect_slide, "turned/drip.svs"),
            "no HEAD": web.add(rect_slide, "nohead/rect.svs"),
            "silent host": f"{silent.url}/rect.svs",
        }
        web.turn_after("turned/drip.svs", 6, "drip")
        for what, url in urls.items():
            started = time.monotonic()
            with (
                pytest.raises(StoreTimeoutError, match="did not answer within its deadlines"),
                Slide(url, "slow") as slide,
            ):
                slide.read(0, 3000, 3000, 1024, 1024)
            # two tries of 2 s at most (storage.retries 1), and the index read honestly
            assert time.monotonic() - started < 8, what
        started = time.monotonic()
        found = locator.stat_slides([f"{silent.url}/{i}.svs" for i in range(64)])
        assert time.monotonic() - started < 8  # one deadline, not 64 / concurrency of them
        assert all(v.startswith("unreadable (the store did not answer") for v in found.values())
    finally:
        silent.stop()


@pytest.mark.parametrize("kept", [0.3, 0.9])
def test_a_store_that_claims_more_bytes_than_it_has_says_so(web, rect_slide, tmp_path, kept):
    """A HEAD that claims 10^15 bytes for an object cut short: the reads past its end are
    refused (416) or answered short, and the line says the object is shorter than its
    store says, not that the store did not answer or that the TIFF is damaged."""
    cut = tmp_path / "cut.svs"
    data = rect_slide.read_bytes()
    cut.write_bytes(data[: int(len(data) * kept)])
    url = web.add(cut, f"huge/cut-{kept}.svs")
    with pytest.raises(SlideReadError) as caught, Slide(url, "huge") as slide:
        for y in range(0, 9000, 1000):
            for x in range(0, 9000, 1000):
                slide.read(0, x, y, 512, 512)
    line = str(caught.value)
    assert "though it said the object has 1000000000000000 bytes" in line
    assert "shorter than its store says" in line and "retries" not in line


def _all_tiles_share_one_jpeg(slide_path, out_path) -> None:
    """`slide_path` rewritten so that every tile entry of each level points to that level's
    one tile at the centre of the tissue (the index of a TIFF is offsets and byte counts)."""
    data = bytearray(slide_path.read_bytes())
    with tifffile.TiffFile(slide_path) as tiff:
        order = tiff.byteorder
        for page in tiff.pages:
            if not page.is_tiled:
                continue
            across = -(-page.imagewidth // page.tilewidth)
            scale = tiff.pages[0].imagewidth / page.imagewidth
            row = int((RECT_TISSUE.y0 + RECT_TISSUE.y1) / 2 / scale) // page.tilelength
            col = int((RECT_TISSUE.x0 + RECT_TISSUE.x1) / 2 / scale) // page.tilewidth
            one = row * across + col
            for tag, value in (
                (page.tags["TileOffsets"], page.dataoffsets[one]),
                (page.tags["TileByteCounts"], page.databytecounts[one]),
            ):
                kind = {4: "I", 16: "Q"}[int(tag.dtype)]  # LONG or LONG8 (BigTIFF)
                values = struct.pack(f"{order}{tag.count}{kind}", *([value] * tag.count))
                data[tag.valueoffset : tag.valueoffset + len(values)] = values
    out_path.write_bytes(bytes(data))


def test_tiles_that_share_bytes_are_fetched_once(s3, rect_slide, tmp_path):
    shared = tmp_path / "shared.svs"
    _all_tiles_share_one_jpeg(rect_slide, shared)
    url = s3.put("cohort", "hostile/shared.svs", shared)
    tiles_path = _tiled(url, tmp_path / "tiles")
    tiles, geometry = read_tiles(tiles_path)
    assert len(tiles) > 100  # more tissue than the rectangle: its tile is everywhere
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(url, "s", coords, geometry, 16)
    with dataset.stream(2, prefetch=2) as stream:
        rows = sum(len(r) for r, _ in stream)
        reads = stream.reads()
    assert rows == len(tiles)
    assert reads["compressed_tiles_decoded"] > 4 * len(tiles) // 2
    assert reads["requests"] <= 12, reads  # the index, and one tile range per worker


@pytest.mark.workflow
def test_a_store_that_never_answers_fails_its_slides_not_the_run(workflow, rect_slide):
    """Named beside a good local slide, a host that accepts connections and never answers
    costs the run's identity check and the doctor a deadline, not hours: the local slide
    finishes, the others fail with the reason."""
    silent = SilentServer()
    try:
        rows = [("local", rect_slide)] + [(f"silent{i}", f"{silent.url}/{i}.svs") for i in range(6)]
        workflow.sheet(rows)
        quick = workflow.dir / "config" / "quick.yaml"
        quick.write_text(json.dumps({"storage": QUICK}))
        started = time.monotonic()
        workflow.run(f"--configfile={quick}", check=False)
        took = time.monotonic() - started
        table = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t")
        status = dict(zip(table["slide_id"], table["status"], strict=True))
        assert status.pop("local") == "done" and set(status.values()) == {"failed"}
        reasons = set(table.loc[table["status"] == "failed", "reason"])
        assert all("did not answer within its deadlines" in reason for reason in reasons)
        assert took < 120, took
        started = time.monotonic()
        doctor = subprocess.run(
            [sys.executable, "-m", "slidesnake", "doctor", "--configfile",
             str(workflow.dir / "config" / "config.yaml"), str(quick)],
            capture_output=True, text=True, cwd=workflow.dir, timeout=120,
        )  # fmt: skip
        assert time.monotonic() - started < 30
        assert "6 of 7 slides cannot be read" in doctor.stdout + doctor.stderr
    finally:
        silent.stop()
