"""Embed: the embedding stage of one slide. Its settings, the one job that reads the tiles
once for a list of model runs (local here; served ones opened by the caller), the loop
that feeds them, the zarr store it writes, progress and watchdog logging, and the GPU
slot a job claims before CUDA starts.

Imports `loader`, `slides` (a slide's size and version, wherever it is kept), `models`,
`tiling` (the tile table), `errors`, `atomic` and `finite`; never the cohort glue.
"""
