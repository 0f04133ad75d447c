"""Snakemake script of rule draw_embedding_map: thin glue to slidesnake.aggregate."""

from slidesnake.aggregate.embedding_map import draw_embedding_map
from slidesnake.cohort.jobs import run_job

run_job(
    lambda: draw_embedding_map(
        zarr_path=snakemake.input.zarr,
        tiles_path=snakemake.input.tiles,
        mask_path=snakemake.input.mask,
        thumbnail_path=snakemake.input.thumbnail,
        out_path=snakemake.output[0],
    ),
    log_path=snakemake.log[0],
    slide_id=snakemake.wildcards.slide_id,
)
