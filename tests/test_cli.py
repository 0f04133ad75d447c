"""The `slidesnake` command's embedding side: embed, export-h5 and bench on a small slide."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from slidesnake import load_embeddings
from slidesnake.cli import main


def test_embed_then_export_from_the_command_line(tmp_path, blob_slide):
    main(["mask", str(blob_slide), str(tmp_path)])
    main(["tiles", str(blob_slide), str(tmp_path)])
    model = ["--model", "timm:test_vit", "--weights", "random", "--precision", "fp32"]
    main(["embed", str(blob_slide), str(tmp_path / "tiles.parquet"), str(tmp_path), *model])
    features, coords, attrs = load_embeddings(tmp_path / "embeddings.zarr")
    assert features.shape == (len(coords), 64) and attrs["model"] == "timm:test_vit"
    main(["export-h5", str(tmp_path / "embeddings.zarr"), str(tmp_path / "slide.h5")])
    with h5py.File(tmp_path / "slide.h5") as f:
        np.testing.assert_array_equal(f["coords"][:], coords)


def test_a_model_list_from_the_command_line_and_one_model_exported(tmp_path, blob_slide, capfd):
    main(["mask", str(blob_slide), str(tmp_path)])
    main(["tiles", str(blob_slide), str(tmp_path)])
    listing = tmp_path / "models.yaml"
    vit, small = "{name: 'timm:test_vit'}", "{name: 'timm:test_vit', input_size: 112}"
    listing.write_text(f"models:\n  vit: {vit}\n  small: {small}\n")
    defaults = ["--weights", "random", "--precision", "fp32", "--models", str(listing)]
    main(["embed", str(blob_slide), str(tmp_path / "tiles.parquet"), str(tmp_path), *defaults])
    vit, _, attrs = load_embeddings(tmp_path / "vit" / "embeddings.zarr")
    small = load_embeddings(tmp_path / "small" / "embeddings.zarr")[2]
    assert attrs["model_key"] == "vit" and small["model_input_px"] == 112
    main(["export-h5", str(tmp_path), str(tmp_path / "vit.h5"), "--model", "vit"])
    with h5py.File(tmp_path / "vit.h5") as f:
        np.testing.assert_array_equal(f["features"][:], vit)
    embed = ["embed", str(blob_slide), str(tmp_path / "tiles.parquet"), str(tmp_path), *defaults]
    for listing_text, said in (
        ("- not a mapping\n", "is not a mapping of model keys to model sections"),
        ("served: {backend: remote, remote: {model: vit}}\n",
         "models.served.backend remote needs models.served.remote.url"),
        ("big: {name: 'timm:test_vit', input_size: 448, input_mpp: 0.5}\n", "set tiles.size: 448"),
    ):  # fmt: skip
        listing.write_text(listing_text)
        with pytest.raises(SystemExit):
            main(embed)
        assert said in capfd.readouterr().err


@pytest.mark.slow  # every stage of the benchmark, in rounds
def test_bench_measures_every_stage_on_the_same_slide(tmp_path, blob_slide, capsys):
    main(
        [
            "bench", "--slide", str(blob_slide), "--workers", "1", "2", "--max-tiles", "40",
            "--repeats", "1", "--model", "timm:test_vit", "--no-memory",
            "--workdir", str(tmp_path), "--json", str(tmp_path / "bench.json"),
        ]
    )  # fmt: skip
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["tiles"] == 40 and results["codec"] == "JPEG"
    assert 40 < results["compressed_tiles_needed"] < 40 * 4  # 224 px tiles on 256 px tiles
    for key in ("decode_only", "per_tile_baseline", "loader_1_workers", "loader_2_workers"):
        assert results[key] > 0
    assert results["model_only"] > 0
    assert len(results["limit_and_loader_rounds"]) == len(results["model_and_job_rounds"]) == 1
    assert set(results["share_of_limit"]) == {"1", "2"} and results["end_to_end_share"] > 0
    assert results["end_to_end"]["tiles"] == 40
    assert results["end_to_end"]["compressed_tiles_decoded"] == results["compressed_tiles_needed"]
    printed = capsys.readouterr().out
    for row in ("decode-only limit", "(baseline)", "our loader, 2 workers", "end to end, 40"):
        assert row in printed
    assert "of min(loader, model)" in printed
