"""Loader: tiles of one slide into batches on the host. Cells of neighbouring tiles cut along
the slide's compressed tiles, readers that decode them, forked worker processes, the
shared batch ring, and the batch stream the embedding loop consumes.

Imports `slides`, `tiling` (the tile geometry) and `errors`. Host side only: torch CPU
tensors, never `torch.cuda` (workers fork, and CUDA must not start before they do), never
models or embedding.
"""
