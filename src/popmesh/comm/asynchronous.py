"""Non-blocking all-reduce: start now, overlap with compute, ``wait()`` later.

``all_reduce_async_(x)`` reduces one array or tensor in place; ``all_reduce_async(x)`` leaves ``x``
alone and ``wait()`` returns the result. Several may be in flight at once (bucketed gradient sync
issues one per bucket); wait for them in the order they were started. Like the blocking form, a call
that does not match the other ranks' raises CollectiveMismatch on every rank (at the start, or at
``wait()`` when the call repeats a verified pattern and its guard ran beside it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from popmesh.comm.agreement import agree
from popmesh.comm.collectives import _setup, describe_one, device_of
from popmesh.comm.fusion import fresh_copy, is_contiguous, write_back
from popmesh.comm.guard import start_checked
from popmesh.comm.reduction import engine_view, finish_, lowering_of
from popmesh.comm.world import Comm
from popmesh.core.arrays import dtype_name, is_torch
from popmesh.core.handles import Completed, Handle, Pending
from popmesh.core.ops import ReduceOp

__all__ = ["AsyncHandle", "all_reduce_async", "all_reduce_async_"]

_NATIVE_AVERAGE = frozenset({"float32", "float64"})  # an engine's own average is then bitwise sum-then-divide


class AsyncHandle(Handle[Any]):
    """A collective in flight. ``done()`` polls without blocking; ``wait()`` returns the result."""


def all_reduce_async(x: Any, op: Any = "sum", *, group: Comm | None = None,
                     timeout: float | None = None) -> AsyncHandle:
    """Start reducing a copy of ``x``; ``wait()`` returns the reduced copy."""
    return _start(x, op, group, timeout, in_place=False)


def all_reduce_async_(x: Any, op: Any = "sum", *, group: Comm | None = None,
                      timeout: float | None = None) -> AsyncHandle:
    """Start reducing ``x`` in place; do not touch ``x`` until ``wait()``, which returns it."""
    return _start(x, op, group, timeout, in_place=True)


def _start(x: Any, op: Any, group: Comm | None, timeout: float | None, *, in_place: bool) -> AsyncHandle:
    reduce_op = op if type(op) is ReduceOp else ReduceOp.parse(op)
    comm, seconds = _setup(group, timeout, "all_reduce_async")
    if not (isinstance(x, np.ndarray) or is_torch(x)):
        raise TypeError("all_reduce_async takes one array or tensor: fuse structures first or use all_reduce")
    lowering = lowering_of(x, reduce_op)
    buf = x if in_place and is_contiguous(x) else fresh_copy(x)
    if comm.size == 1:
        return AsyncHandle(Completed(), seconds, lambda _: x if in_place else buf)
    engine = comm.world.engine
    # An engine that averages float32/64 itself (MPI's shared windows divide each chunk as they sum
    # it) saves the pass over the whole buffer that dividing afterwards costs.
    native = lowering.divide and engine.tuning.averages and dtype_name(x) in _NATIVE_AVERAGE
    engine_op = ReduceOp.AVG if native else lowering.engine_op

    def start(bufs: list[Any]) -> Pending:
        return engine.all_reduce_start(engine_view(bufs[0], lowering), engine_op, comm.handle)

    if comm.check:
        agree(comm, describe_one(reduce_op, x), "all_reduce", seconds)
        pending = start([buf])
    else:
        pending = start_checked(comm, ("all_reduce_async", reduce_op, x.dtype, x.shape, device_of(x)),
                                lambda: describe_one(reduce_op, x, "all_reduce_async"), [buf], start,
                                seconds, "all_reduce", writes_input=buf is x)

    def finish(_: Any) -> Any:
        if not native:
            finish_(buf, lowering, comm.size)
        if in_place and buf is not x:
            write_back(x, buf)
        return x if in_place else buf

    return AsyncHandle(pending, seconds, finish)
