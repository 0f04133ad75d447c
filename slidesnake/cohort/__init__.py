"""Cohort: what the Snakemake workflow needs around the stages. The sample sheet, config
overrides typed from the command line, running a stage as a job with one-line failures,
the cohort summary, and the demo cohort.

Imports `slides` (the demo's synthetic slides), `errors` and `atomic`; never the heavy
stages (torch, the loader, models), so that the workflow's own Python stays light.
"""
