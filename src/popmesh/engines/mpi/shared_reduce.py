"""All-reduce in place inside MPI-3 shared-memory windows, for groups whose members share one node.

MPICH reduces a large array on one node by passing it through its shared-memory cells: every byte
is copied several times and the arithmetic is serialised. When the array already lives in a window
from ``MPI_Win_allocate_shared`` (GradientSync asks for its buckets there, :meth:`SharedArrays.lend`),
no byte needs to move: after a barrier every member reduces one chunk across all members' copies
(in rank order, so the bits are the same whichever rank owns the chunk) and writes the result into
every copy; a second barrier ends it. Measured on the 2-core VM, 40 MB of float32 over 2 ranks:
3.7 ms against 25 ms for MPICH's ``Allreduce`` (benchmarks/grad_sync.py has the training step).
SUM and AVG take one pass over the chunk in C where ``_reduce`` is built (see
:func:`~popmesh.engines.mpi.native.load_reduce`): the same bits as numpy's add, divide and copy,
which take three.

Which path a call takes must be the same on every member, or they wait for each other in different
calls. So the choice is made together: on a group that has lent a window, every all-reduce of at
least :data:`SHARED_FROM_BYTES` first writes where its array lives (window, offset, size, dtype, op)
into a small shared header and meets the others at a barrier; only when every member's header is
the same does the in-place path run, otherwise every member falls back to MPI's own all-reduce (a
window's memory is ordinary memory to MPI). The mismatch guard above has already made the calls
agree, and a rank completing a mismatched call with zeros lands in the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from popmesh.core.ops import ReduceOp
from popmesh.engines.mpi.native import load_reduce

__all__ = ["SHARED_FROM_BYTES", "SharedArrays", "aligned", "chunk_bounds"]

SHARED_FROM_BYTES = 64 << 10
"""Arrays from this size on a lending group take the shared header round (below it the barrier
would be a large share of MPI's own latency, and GradientSync's buckets are megabytes)."""

_ALIGN = 64  # bytes: chunk and bucket boundaries on cache lines, so no two ranks write one line
_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
           ReduceOp.PROD: np.multiply, ReduceOp.AVG: np.add}  # AVG: the sum, then each chunk divided
_OP_CODES = {op: code for code, op in enumerate(_UFUNCS, start=1)}
_KINDS = {np.dtype(t): kind for kind, t in enumerate((np.float32, np.float64, np.int32, np.int64, np.uint32,
                                                       np.uint64))}
_DTYPES = frozenset(_KINDS)  # kind: the dtype's number in _reduce.c
_FLOATS = frozenset(np.dtype(t) for t in (np.float32, np.float64))
_KERNEL_COPIES = 256  # the most members _reduce.combine takes; larger groups use numpy
_HEADER_WORDS = 8  # int64: seq, window (-1: not lent), offset, nbytes, dtype number, op code, 0, 0


def chunk_bounds(numel: int, itemsize: int, parts: int, index: int) -> tuple[int, int]:
    """Element range ``[lo, hi)`` of chunk ``index`` when ``numel`` elements are split in ``parts``
    cache-line aligned chunks (the last ones may be empty for small arrays)."""
    per_line = max(1, _ALIGN // itemsize)
    lines = -(-numel // per_line)
    lo = min(numel, (lines * index // parts) * per_line)
    hi = min(numel, (lines * (index + 1) // parts) * per_line)
    return lo, hi


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a cache line: where the next array of a lent window may start."""
    return -(-nbytes // _ALIGN) * _ALIGN


class _Window:
    """One lent window: every member's copy of the same bytes, as numpy arrays."""

    def __init__(self, mpi: Any, comm: Any, nbytes: int) -> None:
        self.win = mpi.Win.Allocate_shared(nbytes, 1, comm=comm)
        self.win.Lock_all(mpi.MODE_NOCHECK)
        self.copies = [np.frombuffer(self.win.Shared_query(k)[0], dtype=np.uint8, count=nbytes)
                       for k in range(comm.Get_size())]
        self.nbytes = nbytes

    def free(self) -> None:
        self.copies = []
        self.win.Unlock_all()
        self.win.Free()


class SharedArrays:
    """The lent windows of one node-local group and the all-reduce that works inside them.

    ``barrier(timeout, what)``: the engine's barrier over the group (polled, with its timeout and
    liveness check). ``fallback(array, op, timeout)``: MPI's own all-reduce, for calls whose arrays
    are not all in the same place of one window.
    """

    def __init__(self, mpi: Any, comm: Any, barrier: Callable[[float, str], None],
                 fallback: Callable[[np.ndarray, ReduceOp, float], None]) -> None:
        self._mpi, self._comm, self._barrier, self._fallback = mpi, comm, barrier, fallback
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._windows: list[_Window] = []
        self._headers: _Window | None = None
        self._seq = 0
        self._kernel = load_reduce()  # SUM and AVG in one pass, in C, where built; numpy otherwise

    @property
    def lending(self) -> bool:
        """Whether a window was lent: from then on large all-reduces of the group meet in the header."""
        return bool(self._windows)

    def lend(self, sizes: list[int], timeout: float) -> list[np.ndarray]:
        """One new window holding an array of each of ``sizes`` bytes per member, each starting on a
        cache line (no two ranks' chunks share one); this member's arrays, as bytes. Collective."""
        self._barrier(timeout, "GradientSync (shared buckets)")  # a missing member: a timeout, not a hang in MPI
        if self._headers is None:
            self._headers = _Window(self._mpi, self._comm, _HEADER_WORDS * 8)
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + aligned(size))
        window = _Window(self._mpi, self._comm, max(starts[-1], 1))
        self._windows.append(window)
        mine = window.copies[self._rank]
        return [mine[start:start + size] for start, size in zip(starts, sizes)]

    def all_reduce_(self, arr: np.ndarray, op: ReduceOp, timeout: float) -> None:
        """Reduce ``arr`` (at least SHARED_FROM_BYTES) in place: inside its window when every member's
        array is the same place of one, else through the fallback."""
        assert self._headers is not None, "only a lending group meets in the header"
        self._seq += 1
        place = self._place(arr, op)
        mine = self._header(self._rank)
        mine[1:] = (-1, 0, 0, 0, 0, 0, 0) if place is None else place
        mine[0] = self._seq
        self._meet(timeout)
        first = self._header(0)
        same = place is not None and all(np.array_equal(self._header(k), first) for k in range(1, self._size))
        if not same:
            self._fallback(arr, op, timeout)
            return
        window = self._windows[int(first[1])]
        offset, nbytes = int(first[2]), int(first[3])
        copies = [c[offset:offset + nbytes].view(arr.dtype) for c in window.copies]
        lo, hi = chunk_bounds(copies[0].size, arr.dtype.itemsize, self._size, self._rank)
        if (hi > lo and self._kernel is not None and (op is ReduceOp.SUM or op is ReduceOp.AVG)
                and self._size <= _KERNEL_COPIES and offset % arr.dtype.itemsize == 0):
            # one pass, a cache-sized block at a time: the same additions in rank order, then the division
            self._kernel.combine([c[lo:hi] for c in copies], _KINDS[arr.dtype], op is ReduceOp.AVG)
        elif hi > lo:
            # Into member 0's copy, in rank order: only this rank touches [lo, hi) of any copy now.
            ufunc, acc = _UFUNCS[op], copies[0][lo:hi]
            for k in range(1, self._size):
                ufunc(acc, copies[k][lo:hi], out=acc)
            if op is ReduceOp.AVG:
                np.divide(acc, self._size, out=acc)
            for copy in copies[1:]:
                copy[lo:hi] = acc
        self._meet(timeout)

    def free(self) -> None:
        """Release every window (collective: every member calls it, at finalize)."""
        for window in self._windows:
            window.free()
        if self._headers is not None:
            self._headers.free()
        self._windows, self._headers = [], None

    def _place(self, arr: np.ndarray, op: ReduceOp) -> tuple[int, int, int, int, int, int, int] | None:
        """Where ``arr`` lives in a lent window of this member: (window, offset, nbytes, dtype, op, 0, 0)."""
        if (op not in _UFUNCS or arr.dtype not in _DTYPES or not arr.flags.c_contiguous
                or (op is ReduceOp.AVG and arr.dtype not in _FLOATS)):
            return None
        start = arr.__array_interface__["data"][0]
        for index, window in enumerate(self._windows):
            base = window.copies[self._rank].__array_interface__["data"][0]
            if base <= start and start + arr.nbytes <= base + window.nbytes:
                return (index, start - base, arr.nbytes, arr.dtype.num, _OP_CODES[op], 0, 0)
        return None

    def _header(self, k: int) -> np.ndarray:
        assert self._headers is not None
        return self._headers.copies[k].view(np.int64)

    def _meet(self, timeout: float) -> None:
        """A barrier with the memory fences that make every member's writes visible to the others."""
        assert self._headers is not None
        for window in (self._headers, *self._windows):
            window.win.Sync()
        self._barrier(timeout, "all_reduce")
        for window in (self._headers, *self._windows):
            window.win.Sync()
