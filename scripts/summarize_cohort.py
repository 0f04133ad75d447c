"""Snakemake script of rule summarize_cohort: the cohort table of the report."""

from slidesnake.cohort.jobs import run_job
from slidesnake.cohort.summary import write_cohort_html

run_job(
    lambda: write_cohort_html(
        snakemake.params.slide_ids, "results/slides", "logs/slides", snakemake.output[0]
    ),
    log_path=snakemake.log[0],
)
