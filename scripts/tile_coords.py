"""Snakemake script of rule tile_coords: thin glue to slidesnake.tiling.stages."""

from slidesnake.cohort.jobs import run_job
from slidesnake.tiling.artefacts import ArtefactParams
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.regions import read_regions
from slidesnake.tiling.stages import make_tile_coords


def tile() -> None:
    slide_id, roi = snakemake.wildcards.slide_id, snakemake.params.tiles.get("roi")
    classes = snakemake.config["roi"]
    regions = read_regions(roi, slide_id, classes["include"], classes["exclude"]) if roi else None
    make_tile_coords(
        slide_path=snakemake.params.slide,
        slide_id=slide_id,
        mask_path=snakemake.input.mask,
        mask_qc_path=snakemake.input.qc,
        tiles_path=snakemake.output.tiles,
        qc_path=snakemake.output.qc,
        params=TileParams.from_mapping(snakemake.config["tiles"]),
        regions=regions,
        regions_path=roi,
        coords_path=snakemake.params.tiles.get("coords"),
        artefacts=ArtefactParams.from_mapping(snakemake.config["artefacts"]),
    )


run_job(tile, log_path=snakemake.log[0], slide_id=snakemake.wildcards.slide_id)
