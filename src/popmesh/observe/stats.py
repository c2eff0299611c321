"""Distributed statistics: element-wise reductions, global mean/std/min/max, and ragged gathers.

What OmniSafe's ``dist_*`` helpers and torchgfn's ``gather_distributed_data`` do (their facades in
:mod:`popmesh.compat` map onto these), with their bugs fixed:

- :func:`reduce_value` keeps the input's kind, dtype and device (OmniSafe cast everything to
  float32) and never overwrites or returns the caller's tensor (OmniSafe's ``dist_op`` reduced
  float32 tensors in place);
- :func:`mean_std` returns the true global min and max as scalars (OmniSafe's were element-wise
  across ranks) and accepts different lengths per rank, zero included;
- :func:`gather_rows` carries sizes as int64 (torchgfn used the data's dtype, so uint8 or float16
  data corrupted sizes above 255 or 2048), takes any trailing shape and any group.

Cross-rank contract: every rank of ``group`` calls the same function in the same order; element-wise
functions need the same shape on every rank. Importing this module imports neither torch nor numpy
extensions; torch is used only when the input is a tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from popmesh.comm.agreement import exchange_shapes
from popmesh.comm.asynchronous import all_reduce_async_
from popmesh.comm.collectives import all_reduce, gather
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.arrays import flatten, is_torch, unflatten
from popmesh.core.errors import ConfigError
from popmesh.core.ops import ReduceOp
from popmesh.core.timeouts import resolve_timeout

__all__ = ["reduce_value", "is_integral", "mean_std", "gather_rows"]


# ---- element-wise -------------------------------------------------------------------------------
def reduce_value(value: Any, operation: Any, *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """Element-wise ``operation`` across ranks: a new value of the input's kind, dtype and device.

    ``operation``: a :class:`~popmesh.ReduceOp`, a name (``"sum"``, ``"max"``…) or
    ``torch.distributed.ReduceOp.X``. Python and numpy scalars come back as scalars of the same type,
    0-d tensors as 0-d tensors. AVG of integers or booleans is a float (the exact integer sum
    divided by the group size), not a floored integer.
    """
    op = ReduceOp.parse(operation)
    if op is ReduceOp.AVG and is_integral(value):
        return _integer_average(value, group, timeout)
    result = all_reduce(value, op, group=group, timeout=timeout)
    return _fresh(value) if result is value else result  # a world of one returns its input: copy it


def _fresh(value: Any) -> Any:
    leaves, tree = flatten(value)
    return unflatten(tree, [_copy(v) if is_torch(v) or isinstance(v, np.ndarray) else v for v in leaves])


def is_integral(value: Any) -> bool:
    """True for integer and boolean values (Python, numpy or torch), which AVG cannot hold in place."""
    if is_torch(value):
        return not (value.is_floating_point() or value.is_complex())
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in "biu"


def _integer_average(value: Any, group: Comm | None, timeout: float | None) -> Any:
    size = resolve_group(group).size
    if is_torch(value):
        import torch

        total = all_reduce(value.to(torch.int64), "sum", group=group, timeout=timeout)
        return torch.true_divide(total, size)
    if isinstance(value, np.ndarray):
        return np.true_divide(all_reduce(value.astype(np.int64), "sum", group=group, timeout=timeout), size)
    total = all_reduce(np.int64(value), "sum", group=group, timeout=timeout)
    return np.float64(total / size) if isinstance(value, np.generic) else float(total) / size


# ---- global statistics --------------------------------------------------------------------------
def mean_std(value: Any, with_min_max: bool = False, *, group: Comm | None = None,
             timeout: float | None = None) -> tuple[Any, ...]:
    """Global mean and population std (and min, max) over every element on every rank.

    Ranks may hold different numbers of elements, zero included (a rank with none contributes
    nothing; to min/max it contributes +inf/-inf). Sums run in float64 in two passes (sum and count,
    then squared deviations from the global mean), so large offsets do not cancel. With no element
    anywhere every statistic is nan; so is every statistic when any rank holds a NaN (as numpy's),
    and the std when any holds an infinity (the mean is then that infinity, or NaN). Torch input
    gives 0-d tensors (the input's floating dtype, else torch's default float) on its device; numpy
    input numpy scalars; anything else Python floats.
    Costs two collectives latency-wise (min/max travel alongside the first one).
    """
    comm = resolve_group(group)
    local = _Local(value)
    totals = np.array([local.sum, float(local.count), float(local.has_nan)], dtype=np.float64)
    first = all_reduce_async_(totals, "sum", group=comm, timeout=timeout)
    extremes = np.array([local.max, -local.min], dtype=np.float64)
    second = all_reduce_async_(extremes, "max", group=comm, timeout=timeout) if with_min_max else None
    first.wait()
    if second is not None:
        second.wait()
    count = totals[1]
    mean = totals[0] / count if count else math.nan
    squares = all_reduce(np.array([local.squared_deviation(mean)]), "sum", group=comm, timeout=timeout)
    std = math.sqrt(squares[0] / count) if count else math.nan
    stats = [mean, std]
    if with_min_max:  # engines disagree on the MAX of a NaN (gloo skips it, MPI ranks differed): decide here
        stats += [-extremes[1], extremes[0]] if count and not totals[2] else [math.nan, math.nan]
    return tuple(local.wrap(s) for s in stats)


class _Local:
    """One rank's share of the statistics, computed where the data lives (GPU tensors stay there)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        if is_torch(value):
            import torch

            self.data = value.detach().reshape(-1).to(torch.float64)
        else:
            self.data = np.asarray(value, dtype=np.float64).reshape(-1)
        self.count = int(self.data.numel() if is_torch(self.data) else self.data.size)
        self.sum = float(self.data.sum()) if self.count else 0.0
        self.max = float(self.data.max()) if self.count else -math.inf
        self.min = float(self.data.min()) if self.count else math.inf
        # A NaN sum means a NaN or both infinities; only then look for a NaN (costs a pass over the data).
        self.has_nan = math.isnan(self.sum) and bool(self.data.isnan().any() if is_torch(self.data)
                                                     else np.isnan(self.data).any())

    def squared_deviation(self, mean: float) -> float:
        """Sum of squared deviations from the global ``mean``: NaN when the mean is (NaN or infinite data
        anywhere), so the std is NaN like the mean on every rank, not 0."""
        if not self.count:
            return 0.0
        if not math.isfinite(mean):
            return math.nan
        return float(((self.data - mean) ** 2).sum())

    def wrap(self, x: float) -> Any:
        """``x`` as the kind of result the input calls for."""
        if is_torch(self.value):
            import torch

            dtype = self.value.dtype if self.value.is_floating_point() else torch.get_default_dtype()
            return torch.tensor(x, dtype=dtype, device=self.value.device)
        if isinstance(self.value, (np.ndarray, np.generic)):
            dtype = self.value.dtype if self.value.dtype.kind == "f" else np.dtype(np.float64)
            return dtype.type(x)
        return float(x)


# ---- ragged gather ------------------------------------------------------------------------------
def gather_rows(local: Any, group: Comm | None = None, dst: int | None = None, *,
                timeout: float | None = None) -> Any:
    """Concatenate every rank's rows (dim 0) on global rank ``dst``; None on the other ranks.

    ``local``: a tensor or array of any dtype and trailing shape (row counts may differ, zero
    included), or a list whose entries are rows (numbers, or tensors/arrays of equal shape, stacked).
    ``dst`` defaults to the group's first rank. dtypes and trailing shapes must match across ranks
    (CollectiveMismatch on every rank otherwise). Row counts travel as int64, whatever the dtype.
    """
    comm = resolve_group(group)
    comm.require_member("gather_rows")
    root = comm.ranks[0] if dst is None else int(dst)
    comm.to_group_rank(root)  # ConfigError if dst is not a member
    data = _rows(local)
    seconds = resolve_timeout(timeout, comm.timeout, "timeout", "gather_rows")
    if comm.size == 1:
        return _copy(data)
    shapes = exchange_shapes(comm, data, "gather_rows", seconds, same_leading=False)
    rows = [s[0] for s in shapes]
    if max(rows) == 0:
        return _copy(data) if comm.rank == root else None
    padded = _pad_rows(data, max(rows))
    stacked = gather(padded, dst=root, group=comm, timeout=seconds)
    if stacked is None:
        return None
    pieces = [stacked[i, :n] for i, n in enumerate(rows)]
    if is_torch(data):
        import torch

        return torch.cat(pieces)
    return np.concatenate(pieces)


def _rows(local: Any) -> Any:
    if isinstance(local, (list, tuple)):
        if local and all(is_torch(x) for x in local):
            import torch

            return torch.stack(list(local))
        if local and any(is_torch(x) for x in local):
            raise TypeError("gather_rows: a list must hold only tensors or only numbers/arrays")
        return np.asarray(local)
    if not (is_torch(local) or isinstance(local, np.ndarray)):
        raise TypeError(f"gather_rows takes a tensor, an array or a list, not {type(local).__name__}")
    if local.ndim == 0:
        raise ConfigError("gather_rows gathers rows along dim 0: pass at least a 1-d tensor")
    return local


def _pad_rows(data: Any, rows: int) -> Any:
    shape = (rows,) + tuple(data.shape[1:])
    out: Any  # a torch tensor or a numpy array, like data
    if is_torch(data):
        import torch

        out = torch.zeros(shape, dtype=data.dtype, device=data.device)
    else:
        out = np.zeros(shape, dtype=data.dtype)
    out[: data.shape[0]] = data
    return out


def _copy(data: Any) -> Any:
    return data.clone() if is_torch(data) else np.array(data, copy=True)
