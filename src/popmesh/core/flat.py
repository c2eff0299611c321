"""The one flat-buffer mechanism: many arrays or tensors side by side in one contiguous 1-D buffer.

Fused collectives (many small leaves, one call), population snapshots (a model's weights per
dtype) and gradient buckets (``param.grad`` as views into a bucket) all lay leaves out the same way:
leaves are grouped by a key (kind, dtype, device), each leaf takes ``numel`` elements at an offset
of its group's buffer, and the buffer is filled, viewed and written back slice by slice.

The planning (:func:`group_indices`, :func:`packed_offsets`) is pure; the moves
(:func:`flatten_into`, :func:`views_of`, :func:`copy_back`) work on numpy arrays and torch tensors
alike and import torch only when given a tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from popmesh.core.arrays import is_torch

__all__ = ["group_indices", "packed_offsets", "numel_of", "flatten_into", "views_of", "copy_back", "write_back"]


def group_indices(keys: Sequence[Hashable]) -> list[list[int]]:
    """Positions of equal keys, groups in order of first appearance (leaves keep their order)."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of ``sizes`` starts when packed back to back, and the total: ``([0, 3, 5], 9)``
    for ``[3, 2, 4]``."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += int(n)
    return offsets, total


def numel_of(shape: Sequence[int]) -> int:
    """Elements of an array of ``shape`` (1 for a scalar's ``()``)."""
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def flatten_into(parts: Sequence[Any], out: Any = None) -> Any:
    """``parts`` (all numpy or all torch, one dtype) raveled and concatenated in one pass, into
    ``out`` if given (it must hold exactly their elements), else into a new buffer."""
    if is_torch(parts[0]):
        import torch

        flat = [p.reshape(-1) for p in parts]
        return torch.cat(flat) if out is None else torch.cat(flat, out=out)
    flat = [np.ravel(p) for p in parts]
    return np.concatenate(flat) if out is None else np.concatenate(flat, out=out)


def views_of(flat: Any, shapes: Sequence[Sequence[int]], offsets: Sequence[int] | None = None) -> list[Any]:
    """One view of ``flat`` per shape, packed back to back or at the given element ``offsets``."""
    starts = packed_offsets([numel_of(s) for s in shapes])[0] if offsets is None else offsets
    return [flat[start:start + numel_of(shape)].reshape(tuple(shape)) for start, shape in zip(starts, shapes)]


def copy_back(flat: Any, targets: Sequence[Any], offsets: Sequence[int] | None = None) -> None:
    """Write each slice of ``flat`` into its target in place (cast to the target's dtype)."""
    for target, view in zip(targets, views_of(flat, [tuple(t.shape) for t in targets], offsets)):
        write_back(target, view)


def write_back(target: Any, value: Any) -> None:
    """Copy ``value`` into ``target`` in place (cast to its dtype) unless they are the same buffer."""
    if value is target:
        return
    if is_torch(target):
        target.copy_(value)
    else:
        np.copyto(target, value, casting="unsafe")
