"""Snakemake script of rule tissue_mask: thin glue to slidesnake.tiling.stages."""

from slidesnake.cohort.jobs import run_job
from slidesnake.tiling.artefacts import ArtefactParams
from slidesnake.tiling.stages import make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

run_job(
    lambda: make_tissue_mask(
        slide_path=snakemake.params.slide,
        slide_id=snakemake.wildcards.slide_id,
        mask_path=snakemake.output.mask,
        qc_path=snakemake.output.qc,
        params=TissueParams.from_mapping(snakemake.config["tissue"]),
        sheet_mpp=snakemake.params.mpp,
        pen=ArtefactParams.from_mapping(snakemake.config["artefacts"]).pen,
    ),
    log_path=snakemake.log[0],
    slide_id=snakemake.wildcards.slide_id,
)
