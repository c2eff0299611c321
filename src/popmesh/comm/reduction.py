"""Carrying out :func:`popmesh.core.ops.lower` on a buffer: every reducing collective goes through here.

:func:`engine_view` gives the engine the buffer it reduces (booleans as their bytes) and
:func:`finish_` divides an average afterwards, so all_reduce, its async form and reduce_scatter
share one lowering of AVG and booleans.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from popmesh.core.arrays import dtype_name, is_torch
from popmesh.core.ops import Lowering, ReduceOp, lower

__all__ = ["lowering_of", "engine_view", "finish_", "divide_", "first_element", "set_first_"]


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


_TORCH_CTYPES: dict[Any, Any] = {}  # torch dtype -> the ctypes type that reads one element in place


def first_element(buf: Any, as_bytes: bool = False) -> float | int:
    """Element 0 of ``buf`` (in C order) as a Python number; ``as_bytes``: its first byte. Cheap: a
    CPU tensor's is read in place (``.item()`` costs 2-4 us, a few times the whole check)."""
    if type(buf) is np.ndarray:
        return int(buf.view(np.uint8).item(0)) if as_bytes else buf.item(0)
    if not _TORCH_CTYPES:
        _torch_readers()
    if as_bytes:
        buf = buf.view(_TORCH_CTYPES["uint8"])
    reader = _TORCH_CTYPES.get(buf.dtype) if buf.is_cpu else None
    if reader is not None:
        return reader.from_address(buf.data_ptr()).value
    return buf.reshape(-1)[0].item()


def _torch_readers() -> None:
    import torch

    _TORCH_CTYPES.update({torch.float32: ctypes.c_float, torch.float64: ctypes.c_double,
                          torch.int8: ctypes.c_int8, torch.int16: ctypes.c_int16, torch.int32: ctypes.c_int32,
                          torch.int64: ctypes.c_int64, torch.uint8: ctypes.c_uint8, "uint8": torch.uint8})


def set_first_(buf: Any, value: float | int, as_bytes: bool = False) -> None:
    """Write ``value`` into element 0 of the contiguous ``buf`` (``as_bytes``: into its first byte)."""
    if is_torch(buf):
        import torch

        (buf.view(torch.uint8) if as_bytes else buf).view(-1)[0] = value
    else:
        (buf.view(np.uint8) if as_bytes else buf).reshape(-1)[0] = value
