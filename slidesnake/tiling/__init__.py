"""Tiling: tissue detection, the mask file, the tile grid, the tile table, QC pictures, and
the mask and tile stages of one slide that put them together.

Imports `slides`, `errors`, `atomic` and `side_files`; never torch, the loader, models or
embedding.
"""
