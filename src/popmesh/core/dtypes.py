"""The one dtype table: every element type popmesh moves, its size, and its stable wire code.

Names follow numpy and torch (``float32``, ``bfloat16``); a torch or numpy prefix is accepted
(``torch.bfloat16``). Wire codes are part of the frame format (:mod:`popmesh.wire.format`) and never
change meaning; a new dtype gets a new code.
"""

from __future__ import annotations

import types
from typing import NamedTuple

from popmesh.core.errors import ConfigError

__all__ = ["DType", "DTYPES", "ITEMSIZE", "WIRE_CODES", "canonical_dtype", "itemsize"]


class DType(NamedTuple):
    name: str
    wire_code: int
    itemsize: int


DTYPES: tuple[DType, ...] = (
    DType("bool", 1, 1), DType("int8", 2, 1), DType("int16", 3, 2), DType("int32", 4, 4), DType("int64", 5, 8),
    DType("uint8", 6, 1), DType("uint16", 7, 2), DType("uint32", 8, 4), DType("uint64", 9, 8),
    DType("float16", 10, 2), DType("float32", 11, 4), DType("float64", 12, 8), DType("bfloat16", 13, 2),
    DType("complex64", 14, 8), DType("complex128", 15, 16),
)
ITEMSIZE = types.MappingProxyType({d.name: d.itemsize for d in DTYPES})
WIRE_CODES = types.MappingProxyType({d.name: d.wire_code for d in DTYPES})


def canonical_dtype(dtype: object) -> str:
    """``float32`` for ``torch.float32``, ``numpy.float32`` or ``float32``; float8 variants pass as
    they are. ConfigError for a dtype popmesh does not know."""
    name = str(dtype).removeprefix("torch.").removeprefix("jnp.").removeprefix("numpy.")
    if name in ITEMSIZE or name.startswith("float8_"):
        return name
    raise ConfigError(f"unknown dtype {dtype!r}; use a numpy/torch name such as {', '.join(sorted(ITEMSIZE))} "
                      "or float8_*")


def itemsize(dtype: object) -> int:
    """Bytes per element of a dtype named like numpy or torch."""
    name = canonical_dtype(dtype)
    return 1 if name.startswith("float8_") else ITEMSIZE[name]
