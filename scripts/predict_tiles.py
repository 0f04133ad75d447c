"""Snakemake script of rule predict_tiles: rule_jobs.predict_tiles, run in a warm
interpreter when one serves this workflow, else in this process (see slidesnake.cohort.warm)."""

from slidesnake.cohort.warm import run_rule

run_rule(snakemake, "predict_tiles")
