"""popmesh's one wire format: the frame layout, encoding and decoding. Pure; engines frame with it.

:mod:`~popmesh.wire.format` defines the frame (header, dtype and kind codes, joining parts),
:mod:`~popmesh.wire.encoding` and :mod:`~popmesh.wire.decoding` turn payloads into frames and back,
and :mod:`~popmesh.wire.objects` is the codec of the ``*_object`` collectives.
"""

from popmesh.wire.decoding import decode, read_header
from popmesh.wire.encoding import encode, encode_message
from popmesh.wire.format import (
    CHECKSUM_AUTO_LIMIT,
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_NBYTES,
    MAGIC,
    SMALL_FRAME_NBYTES,
    FrameHeader,
    Kind,
    frame_nbytes,
    join_frame,
)

__all__ = [
    "CHECKSUM_AUTO_LIMIT", "DTYPE_CODES", "FORMAT_VERSION", "HEADER_NBYTES", "MAGIC", "SMALL_FRAME_NBYTES",
    "FrameHeader", "Kind", "decode", "encode", "encode_message", "frame_nbytes", "join_frame", "read_header",
]
