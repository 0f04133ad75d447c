"""Loader: tiles of one slide into batches on the host. Cells of neighbouring tiles cut along
the slide's compressed tiles, readers that decode them, forked worker processes, the
shared batch ring, and the batch stream the embedding loop consumes.

Imports `slides`, `tiling` (the tile geometry) and `errors`. Host side only: numpy arrays,
never torch (workers fork, and CUDA must not start before they do; a remote-backend job
has no torch at all), never models or embedding.
"""
