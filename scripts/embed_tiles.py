"""Snakemake script of rule embed_tiles: rule_jobs.embed_tiles, run in a warm
interpreter when one serves this workflow, else in this process (see slidesnake.cohort.warm)."""

from slidesnake.cohort.warm import run_rule

run_rule(snakemake, "embed_tiles")
