"""Carrying out :func:`popmesh.core.ops.lower` on a buffer: every reducing collective goes through here.

:func:`engine_view` gives the engine the buffer it reduces (booleans as their bytes) and
:func:`finish_` divides an average afterwards, so all_reduce, its async form and reduce_scatter
share one lowering of AVG and booleans.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from popmesh.core.arrays import dtype_name, is_torch
from popmesh.core.ops import Lowering, ReduceOp, lower

__all__ = ["lowering_of", "engine_view", "finish_", "divide_"]


def lowering_of(a: Any, op: ReduceOp) -> Lowering:
    """The lowering of ``op`` for ``a``'s dtype; ConfigError if that reduction is undefined."""
    return lower(op, dtype_name(a))


def engine_view(buf: Any, lowering: Lowering) -> Any:
    """``buf`` as the engine reduces it: itself, or its bytes as uint8 for booleans (a view, no copy)."""
    if not lowering.as_bytes:
        return buf
    if is_torch(buf):
        import torch

        return buf.view(torch.uint8)
    return buf.view(np.uint8)


def finish_(out: Any, lowering: Lowering, size: int) -> Any:
    """Complete a lowered reduction in place (divide an average by ``size``); returns ``out``."""
    if lowering.divide:
        divide_(out, size)
    return out


def divide_(buf: Any, n: int) -> None:
    """``buf /= n`` in place; integers divide with floor, as torch and numpy do for integer averages."""
    if is_torch(buf):
        if buf.is_floating_point() or buf.is_complex():
            buf.div_(n)
        else:
            buf.floor_divide_(n)
    elif buf.dtype.kind in "iu":
        np.floor_divide(buf, n, out=buf)
    else:
        np.divide(buf, n, out=buf)
