"""Slides: opening a whole-slide image, its microns per pixel, low-resolution reads, the
TIFF tile decoder and synthetic slides for tests and benchmarks.

The bottom of the package: imports nothing of ours but `slidesnake.errors`, and no torch.
"""
