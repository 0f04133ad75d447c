"""Cohort: what the Snakemake workflow needs around the stages. The sample sheet, the
config (defaults, typed overrides, schema check), each rule's params, each rule's job and
running it with one-line failures, the warm interpreter that forks jobs, the cohort
summary, and the demo cohort.

Imports `slides`, `tiling` and `embed` (their settings and the demo's synthetic slides),
`aggregate`, `remote` and `models` (inside the rule jobs only), `errors`, `atomic` and `side_files`;
never torch, timm, the loader or models' heavy side at import, so that the workflow's own
Python stays light (tests/test_boundaries.py imports it to check).
"""
