"""Embed: the embedding stage of one slide. Its settings, the loop that feeds batches from
the loader to the model (or to several, from one read), the zarr store it writes,
progress and watchdog logging, and the GPU slot a job claims before CUDA starts.

Imports `loader`, `slides` (a slide's size and version, wherever it is kept), `models`,
`tiling` (the tile table), `errors`, `atomic` and `finite`; never the cohort glue.
"""
