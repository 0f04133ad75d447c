"""Snakemake script of rule pool_slide: thin glue to slidesnake.aggregate."""

from slidesnake.aggregate.slide_table import slide_features, write_slide_features
from slidesnake.cohort.jobs import run_job

run_job(
    lambda: write_slide_features(
        slide_features(
            slide_id=snakemake.wildcards.slide_id,
            zarr_path=snakemake.input.zarr,
            tiles_path=snakemake.input.tiles,
            poolings=snakemake.config["slide"]["pooling"],
            encoder=snakemake.config["slide"]["encoder"],
        ),
        snakemake.output[0],
    ),
    log_path=snakemake.log[0],
    slide_id=snakemake.wildcards.slide_id,
)
