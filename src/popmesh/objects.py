"""The safe object codec used by the ``*_object`` collectives: JSON by default, pickle only on request.

A pickle frame is refused unless the receiver also passed ``allow_pickle=True``, so a peer can never
make this rank run arbitrary code by accident.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np

from .errors import MessageError

__all__ = ["encode_object", "decode_object"]

_JSON, _PICKLE = b"J", b"P"


def encode_object(obj: Any, *, allow_pickle: bool = False) -> np.ndarray:
    """``obj`` as a uint8 array: JSON if it is JSON-able, else pickle when ``allow_pickle``."""
    try:
        raw = _JSON + json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()
    except (TypeError, ValueError):
        if not allow_pickle:
            raise TypeError(
                f"a {type(obj).__name__} is not JSON-able: pass allow_pickle=True on every rank to send it pickled"
            ) from None
        raw = _PICKLE + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def decode_object(buf: Any, *, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode_object`; MessageError for corrupt input or a refused pickle."""
    raw = bytes(np.asarray(buf, dtype=np.uint8))
    kind, body = raw[:1], raw[1:]
    if kind == _JSON:
        try:
            return json.loads(body)
        except ValueError as e:
            raise MessageError(f"corrupt JSON object frame: {e}") from e
    if kind == _PICKLE:
        if not allow_pickle:
            raise MessageError("received a pickled object: pass allow_pickle=True on every rank to accept it")
        return pickle.loads(body)
    raise MessageError(f"unknown object frame kind {kind!r}: the peer is not speaking popmesh's codec")
