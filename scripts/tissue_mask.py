"""Snakemake script of rule make_tissue_mask: rule_jobs.make_tissue_mask, run in a warm
interpreter when one serves this workflow, else in this process (see slidesnake.cohort.warm)."""

from slidesnake.cohort.warm import run_rule

run_rule(snakemake, "make_tissue_mask")
