"""A TIFF JPEG tile as a whole JPEG stream, for decoders that read nothing else.

TIFF stores a level's quantisation and Huffman tables once (JPEGTables) and each tile as
an abbreviated stream without them, and says in its own tags whether three components are
YCbCr or RGB as stored (Aperio's quirk). libjpeg-turbo's TurboJPEG API (simplejpeg) and
nvImageCodec read whole streams and guess the colour space, so a tile becomes one: the
page's tables spliced in after the tile's SOI, and for photometric RGB tiles an Adobe
marker that says "no colour transform", which is how those decoders learn what tifffile
tells imagecodecs.
"""

from __future__ import annotations

import tifffile

# APP14 "Adobe", version 100, no flags, transform 0: three components are RGB as stored.
_ADOBE_RGB = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"
PHOTOMETRIC_RGB = 2


class JpegStreams:
    """Makes whole JPEG streams of the tiles of one TIFF page."""

    def __init__(self, page: tifffile.TiffPage) -> None:
        adobe = _ADOBE_RGB if page.photometric == PHOTOMETRIC_RGB else b""
        tables = page.jpegtables[2:-2] if page.jpegtables else b""  # without SOI and EOI
        self._header = adobe + tables

    def __call__(self, data: bytes | memoryview) -> bytes:
        """The tile's bytes as a whole stream (from a file's bytes or a store's memoryview
        alike)."""
        return b"".join((data[:2], self._header, data[2:]))
