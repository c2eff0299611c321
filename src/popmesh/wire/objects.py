"""The object codec of the ``*_object`` collectives: popmesh's one wire format (see ``wire``).

JSON values, bytes, arrays, tensors and dicts of arrays travel without pickle; anything else needs
``allow_pickle=True`` on the sender *and* the receiver, so a peer can never make this rank run
arbitrary code by accident.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from popmesh.wire import decode, encode, join_frame

__all__ = ["encode_object", "decode_object"]


def encode_object(obj: Any, *, allow_pickle: bool = False) -> np.ndarray:
    """``obj`` as one contiguous uint8 frame; MessageError if it needs pickle and that is not allowed."""
    return join_frame(encode(obj, allow_pickle=allow_pickle))


def decode_object(buf: Any, *, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode_object`; MessageError for a corrupt frame or a refused pickle."""
    return decode(np.ascontiguousarray(buf, dtype=np.uint8), allow_pickle=allow_pickle)
