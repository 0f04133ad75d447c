"""Snakemake script of rule draw_embedding_map: rule_jobs.draw_embedding_map, run in a warm
interpreter when one serves this workflow, else in this process (see slidesnake.cohort.warm)."""

from slidesnake.cohort.warm import run_rule

run_rule(snakemake, "draw_embedding_map")
