"""Snakemake script of rule list_cohort_slides: the sheet's slide ids, which a new sheet
(or a summary killed half-way) makes Snakemake write again, so that the run writes the
cohort summary even when every slide is already done."""

from slidesnake.cohort.jobs import run_job
from slidesnake.cohort.summary import write_cohort_slides

run_job(
    lambda: write_cohort_slides(list(snakemake.params.slides), snakemake.output[0]),
    log_path=snakemake.log[0],
)
