"""Preparing leaves for an engine: contiguous copies, fusing many small leaves into one buffer per
(kind, dtype, device) with :mod:`popmesh.core.flat`, splitting results back, and writing results into
the caller's leaves.

Fusion is what makes a nested structure of many small tensors cost one collective instead of one per
tensor (gloo: 10-20x on small RL models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popmesh.core.arrays import device_name, dtype_name, is_torch
from popmesh.core.flat import flatten_into, group_indices, views_of, write_back

__all__ = ["fresh_copy", "is_contiguous", "fuse_groups", "write_back", "apply_fused"]


def is_contiguous(x: Any) -> bool:
    """Contiguous and writeable, so an engine may work on it in place."""
    if is_torch(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous and x.flags.writeable)


def fresh_copy(x: Any) -> Any:
    """A contiguous copy the engine may overwrite."""
    if is_torch(x):
        import torch

        return x.detach().clone(memory_format=torch.contiguous_format)
    return np.array(x, copy=True, order="C")


def fuse_groups(leaves: Sequence[Any]) -> list[list[int]]:
    """Indices of leaves that can share one buffer: same kind (numpy/torch), dtype and device."""
    return group_indices([(is_torch(leaf), dtype_name(leaf), device_name(leaf)) for leaf in leaves])


def apply_fused(leaves: Sequence[Any], run: Callable[[Any], None], *, in_place: bool) -> list[Any]:
    """Run the in-place engine op ``run`` once per fusable group; return one result per leaf.

    With ``in_place`` a lone contiguous leaf is handed to the engine directly (no copy) and fused
    results are copied back into the caller's leaves.
    """
    results: list[Any] = [None] * len(leaves)
    for idx in fuse_groups(leaves):
        parts = [leaves[i] for i in idx]
        if len(idx) == 1:
            buf = parts[0] if in_place and is_contiguous(parts[0]) else fresh_copy(parts[0])
            run(buf)
            results[idx[0]] = buf
            continue
        flat = flatten_into(parts)
        run(flat)
        for i, piece in zip(idx, views_of(flat, [tuple(p.shape) for p in parts])):
            results[i] = piece
    if in_place:
        for leaf, result in zip(leaves, results):
            write_back(leaf, result)
    return results

