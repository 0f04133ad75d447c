"""Aggregate: what comes after the tile embeddings of a slide. Slide-level features
(pooling, or a slide encoder program), the embedding map picture, and the cohort's table
of slide features.

Imports `embed` (the store), `tiling` (tile table, mask, QC pictures), `models` (the
checked loading of programs), `errors`, `atomic` and `finite`; never the loader.
"""
