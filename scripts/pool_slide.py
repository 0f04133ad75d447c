"""Snakemake script of rule pool_slide: rule_jobs.pool_slide, run in a warm
interpreter when one serves this workflow, else in this process (see slidesnake.cohort.warm)."""

from slidesnake.cohort.warm import run_rule

run_rule(snakemake, "pool_slide")
