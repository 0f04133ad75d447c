"""Models: the registry of foundation models, checkpoints in every format (checked so that
no code runs from a file), and the embedder that preprocesses and runs a batch on its
device.

Imports `errors` and `side_files` (a checkpoint is a regular file) only; never the loader,
tiling or embedding, so that a model can be built and tested without a slide.
"""
