"""Snakemake script of rule predict_tiles: thin glue to slidesnake.aggregate."""

from slidesnake.aggregate.head import load_head, predict_slide, write_predictions
from slidesnake.aggregate.heatmaps import draw_heatmaps
from slidesnake.cohort.jobs import run_job
from slidesnake.tiling.tile_table import read_tiles


def predict() -> None:
    head = snakemake.config["head"]
    loaded = load_head(head["checkpoint"], head["classes"], head["activation"])
    tiles, slide = predict_slide(loaded, snakemake.input.zarr)
    write_predictions(tiles, slide, snakemake.output.tiles, snakemake.output.slide)
    _, geometry = read_tiles(snakemake.input.tiles)
    draw_heatmaps(
        tiles,
        [column for column in tiles.columns if column not in ("x", "y")],
        geometry.size_level0,
        snakemake.input.mask,
        snakemake.input.thumbnail,
        snakemake.output.heatmaps,
    )


run_job(predict, log_path=snakemake.log[0], slide_id=snakemake.wildcards.slide_id)
