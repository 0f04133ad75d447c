"""Snakemake script of rule tile_coords: thin glue to slidesnake.tiling.stages."""

from slidesnake.cohort.jobs import run_job
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords

run_job(
    lambda: make_tile_coords(
        slide_path=snakemake.params.slide,
        slide_id=snakemake.wildcards.slide_id,
        mask_path=snakemake.input.mask,
        mask_qc_path=snakemake.input.qc,
        tiles_path=snakemake.output.tiles,
        qc_path=snakemake.output.qc,
        params=TileParams.from_mapping(snakemake.config["tiles"]),
    ),
    log_path=snakemake.log[0],
    slide_id=snakemake.wildcards.slide_id,
)
