"""Non-blocking all-reduce: start now, overlap with compute, ``wait()`` later.

``all_reduce_async_(x)`` reduces one array or tensor in place; ``all_reduce_async(x)`` leaves ``x``
alone and ``wait()`` returns the result. Several may be in flight at once (bucketed gradient sync
issues one per bucket); wait for them in the order they were started.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from popmesh.core.arrays import dtype_name, is_torch
from popmesh.comm.collectives import _divide_, _require_reducible, _setup, _uint8_of
from popmesh.engines.base import Completed, Pending
from popmesh.comm.fusion import fresh_copy, is_contiguous, write_back
from popmesh.core.ops import ReduceOp
from popmesh.comm.world import Comm

__all__ = ["AsyncHandle", "all_reduce_async", "all_reduce_async_"]


class AsyncHandle:
    """A collective in flight. ``done()`` polls without blocking; ``wait()`` returns the result."""

    def __init__(self, pending: Pending, finish: Callable[[], Any], timeout: float) -> None:
        self._pending, self._finish, self._timeout = pending, finish, timeout
        self._result: Any = None
        self._waited = False

    def done(self) -> bool:
        return self._waited or self._pending.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished (CommTimeout after ``timeout`` seconds) and return the result."""
        if not self._waited:
            self._pending.wait(self._timeout if timeout is None else float(timeout))
            self._result = self._finish()
            self._waited = True
        return self._result


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
    _require_reducible(x, reduce_op)
    buf = x if in_place and is_contiguous(x) else fresh_copy(x)
    if comm.size == 1:
        return AsyncHandle(Completed(), lambda: x if in_place else buf, seconds)
    engine = comm.world.engine
    is_bool = dtype_name(buf) == "bool"
    if is_bool:
        engine_op = ReduceOp.MAX if reduce_op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        pending = engine.all_reduce_start(buf.view(_uint8_of(buf)), engine_op, comm.handle)
    else:
        engine_op = ReduceOp.SUM if reduce_op is ReduceOp.AVG else reduce_op
        pending = engine.all_reduce_start(buf, engine_op, comm.handle)

    def finish() -> Any:
        if reduce_op is ReduceOp.AVG:
            _divide_(buf, comm.size)
        if in_place and buf is not x:
            write_back(x, buf)
        return x if in_place else buf

    return AsyncHandle(pending, finish, seconds)
