"""Models: the registry of foundation models, checkpoints in every format (checked so that
no code runs from a file), the embedder that preprocesses and runs a batch on its device,
and weight files carried to clusters without internet.

Imports `errors`, `side_files` (a checkpoint is a regular file) and `atomic` (a weights
manifest) only; never the loader, tiling or embedding, so that a model can be built and
tested without a slide.
"""
