"""A bounded FIFO of batch rows, the local store of managers and clients, and batch helpers.

A batch is a dict of str to numpy arrays or torch tensors sharing their leading (row) dimension.
The store keeps whole batches as received and evicts the oldest rows first once more than
``capacity`` rows are held. Every batch it holds has the same keys, the same row shape per key and
dtypes of one kind (real numbers of any width mix): a batch that does not fit is refused whole, so
one bad batch never makes the stored columns unreadable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from popmesh.buffers.protocol import batch_size
from popmesh.core.arrays import is_torch
from popmesh.core.errors import ConfigError

__all__ = ["LocalStore", "concat_batches", "select_rows", "to_numpy"]

_REAL_KINDS = "biuf"  # bool, int, uint, float: rows of these kinds join (numpy promotes them)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view or copy of an array or CPU/GPU tensor (bfloat16 tensors become float32)."""
    if is_torch(x):
        import torch

        t = x.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(x)


def _row_spec(value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape of one row, numpy dtype) of a batch entry; tensors are not copied whole to find out."""
    return tuple(int(d) for d in value.shape[1:]), to_numpy(value[:0]).dtype


def concat_batches(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows of ``batches`` (same keys) joined in order; torch values stay torch."""
    if len(batches) == 1:
        return batches[0]
    keys = list(batches[0])
    if any(list(b) != keys for b in batches):
        raise ConfigError(f"batches to join have different keys: {[list(b) for b in batches]}")
    out: dict[str, Any] = {}
    for key in keys:
        values = [b[key] for b in batches]
        if is_torch(values[0]):
            import torch

            out[key] = torch.cat(values)
        else:
            out[key] = np.concatenate(values)
    return out


def select_rows(batch: dict[str, Any], rows: Any) -> dict[str, Any]:
    """The rows of ``batch`` picked by a boolean mask or an index array."""
    if any(is_torch(v) for v in batch.values()):
        import torch

        index = torch.as_tensor(np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows))
        return {k: v[index.to(v.device)] if is_torch(v) else v[index.numpy()] for k, v in batch.items()}
    return {k: v[rows] for k, v in batch.items()}


class LocalStore:
    """At most ``capacity`` rows, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity={capacity!r} must be a positive number of rows")
        self.capacity = capacity
        self._chunks: deque[dict[str, Any]] = deque()
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    @property
    def is_full(self) -> bool:
        return self._rows >= self.capacity

    def check(self, batch: dict[str, Any]) -> None:
        """ConfigError, naming the entry, unless ``batch`` can join the stored rows (see the module docstring)."""
        batch_size(batch)
        if not self._chunks:
            return
        stored = self._chunks[0]
        if list(batch) != list(stored):
            raise ConfigError(f"batch keys {list(batch)} differ from the stored {list(stored)}: send the same keys "
                              "in every batch")
        for key, value in batch.items():
            (shape, dtype), (old_shape, old_dtype) = _row_spec(value), _row_spec(stored[key])
            if shape != old_shape or not _joins(dtype, old_dtype):
                raise ConfigError(f"batch entry {key!r} has rows of shape {shape} and dtype {dtype}, the stored rows "
                                  f"have shape {old_shape} and dtype {old_dtype}: send rows of the stored shape and "
                                  "kind of dtype")

    def add(self, batch: dict[str, Any]) -> int:
        """Append ``batch``'s rows (ConfigError if they cannot join the stored ones, see :meth:`check`);
        returns how many old rows were evicted."""
        self.check(batch)
        n = batch_size(batch)
        if n > self.capacity:
            batch, n = {k: v[n - self.capacity:] for k, v in batch.items()}, self.capacity
        self._chunks.append(batch)
        self._rows += n
        evicted = 0
        while self._rows > self.capacity:
            oldest = self._chunks[0]
            rows, excess = batch_size(oldest), self._rows - self.capacity
            if rows <= excess:
                self._chunks.popleft()
                self._rows, evicted = self._rows - rows, evicted + rows
            else:
                self._chunks[0] = {k: v[excess:] for k, v in oldest.items()}
                self._rows, evicted = self._rows - excess, evicted + excess
        return evicted

    def column(self, key: str) -> np.ndarray | None:
        """All stored rows of ``key`` as one numpy array (None when empty or ``key`` is not stored)."""
        if not self._chunks or key not in self._chunks[0]:
            return None
        return np.concatenate([to_numpy(c[key]) for c in self._chunks])

    def keys(self) -> list[str]:
        return list(self._chunks[0]) if self._chunks else []


def _joins(dtype: np.dtype, stored: np.dtype) -> bool:
    """True if rows of ``dtype`` may join rows of ``stored``: the same kind, or both real numbers. (Strings
    and numbers would concatenate into strings, and every later score would fail.)"""
    return dtype.kind == stored.kind or (dtype.kind in _REAL_KINDS and stored.kind in _REAL_KINDS)
