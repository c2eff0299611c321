"""MPI-3 one-sided snapshot windows: every rank publishes a byte snapshot, any rank reads any other's.

One window per communicator, allocated by MPI (``MPI_Win_allocate``) so that ranks on one node
reach each other's memory directly, and kept in a passive-target ``Lock_all(MODE_NOCHECK)`` epoch
for its whole life: a read never waits for a lock and never needs the owner to call MPI. (Under
MPICH, ``Lock(SHARED)``/``Lock(EXCLUSIVE)`` on a target only progress when the target itself enters
MPI, so a reader would stall until a busy donor's next MPI call.)

Reads are made tear-free by **double buffering with a sequence counter** (a seqlock per slot):

* memory layout: ``[latest slot][slot 0][slot 1]``, each slot ``[seq, iteration, metric, nbytes,
  payload...]`` (int64 words, the metric a float64);
* the owner writes the slot *not* announced as latest: seq ← odd, barrier, payload + header,
  barrier, seq ← even, barrier, then announces the slot as latest;
* a reader reads the announced slot's seq (retrying while odd), the header and payload, then seq
  again, and accepts the copy only if both seq values are equal. The owner only rewrites a slot two
  publishes later, so a reader normally succeeds at the first attempt.

Creation and :meth:`MpiSnapshotWindow.free` are collective over the communicator; publish and read
are not. Across nodes, networks without remote-memory hardware may still need the owner to enter
MPI for reads to progress; set ``MPIR_CVAR_ASYNC_PROGRESS=1`` (MPICH) there.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from popmesh.core.errors import CommTimeout, ConfigError, PeerFailure
from popmesh.engines.base import Snapshot
from popmesh.engines.mpi.devices import require_host

__all__ = ["MpiSnapshotWindow"]

_WORD = 8
_SLOT_HEADER = 4 * _WORD  # seq, iteration, metric, nbytes
_GLOBAL = 2 * _WORD       # latest slot (-1: nothing published yet), reserved


class MpiSnapshotWindow:
    """A window of ``nbytes`` payload bytes per rank of ``handle`` (an MPI engine group handle);
    ``mpi`` is the ``mpi4py.MPI`` module the engine loaded.

    Collective to create: every member passes the same ``nbytes``. Targets are **group ranks**.
    """

    def __init__(self, mpi: Any, handle: Any, nbytes: int) -> None:
        if handle is None or not hasattr(handle, "comm"):
            raise ConfigError("MpiSnapshotWindow needs a group handle of the mpi engine")
        self._mpi = MPI = mpi
        self.comm = handle.comm
        self._ranks = handle.spec.ranks  # global rank of each group rank
        self.nbytes = int(nbytes)
        self._slot_bytes = _SLOT_HEADER + -(-self.nbytes // _WORD) * _WORD
        total = _GLOBAL + 2 * self._slot_bytes
        try:
            self._win = MPI.Win.Allocate(total, 1, comm=self.comm)
        except MPI.Exception as e:
            suspects = [r for i, r in enumerate(self._ranks) if i != self.comm.Get_rank()]
            raise PeerFailure(f"creating a {total}-byte RMA window failed in MPI: {e}", suspects or self._ranks,
                              exact=False) from e
        self._mem = np.frombuffer(self._win.tomemory(), dtype=np.uint8, count=total)
        self._mem[:] = 0
        self._words(0, 1)[0] = -1
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._win.Sync()
        self.comm.Barrier()
        self._latest = -1
        self._freed = False

    def _words(self, offset: int, count: int) -> np.ndarray:
        return self._mem[offset:offset + count * _WORD].view(np.int64)

    def _slot(self, slot: int) -> int:
        return _GLOBAL + slot * self._slot_bytes

    def publish(self, payload: np.ndarray, iteration: int, metric: float) -> None:
        """Make ``payload`` (``nbytes`` uint8, in host memory: a CUDA tensor is refused) this rank's
        latest snapshot. Local: no peer takes part."""
        self._check_open()
        require_host(payload, "a one-sided window's publish")
        data = np.asarray(payload).reshape(-1).view(np.uint8)
        if data.size != self.nbytes:
            raise ConfigError(f"publish got {data.size} bytes for a window of {self.nbytes}")
        slot = 0 if self._latest != 0 else 1
        base = self._slot(slot)
        head = self._words(base, 4)
        seq = int(head[0])
        head[0] = seq + 1
        self._win.Sync()
        self._mem[base + _SLOT_HEADER:base + _SLOT_HEADER + self.nbytes] = data
        head[1] = int(iteration)
        head[2:3].view(np.float64)[0] = float(metric)
        head[3] = self.nbytes
        self._win.Sync()
        head[0] = seq + 2
        self._win.Sync()
        self._words(0, 1)[0] = slot
        self._win.Sync()
        self._latest = slot

    def _get(self, out: np.ndarray, target: int, offset: int) -> None:
        MPI = self._mpi
        self._win.Get([out, MPI.BYTE], target, (offset, out.nbytes, MPI.BYTE))
        self._win.Flush(target)

    def _latest_of(self, target: int) -> int:
        word = np.empty(1, dtype=np.int64)
        self._get(word.view(np.uint8), target, 0)
        return int(word[0])

    def read(self, target: int, timeout: float, with_data: bool = True) -> Snapshot | None:
        """A consistent copy of group rank ``target``'s latest snapshot (None if it has published
        nothing yet); ``with_data=False`` reads only iteration and metric. CommTimeout if no
        consistent copy could be taken within ``timeout`` seconds."""
        self._check_open()
        head = np.empty(4, dtype=np.int64)
        seq = np.empty(1, dtype=np.int64)
        data = np.empty(self.nbytes if with_data else 0, dtype=np.uint8)
        deadline = time.monotonic() + timeout
        pause = 1e-5
        try:
            while True:
                slot = self._latest_of(target)
                if slot < 0:
                    return None
                base = self._slot(slot)
                self._get(head.view(np.uint8), target, base)
                if head[0] % 2 == 0:
                    if with_data:
                        self._get(data, target, base + _SLOT_HEADER)
                    self._get(seq.view(np.uint8), target, base)
                    if seq[0] == head[0]:
                        return Snapshot(int(head[1]), float(head[2:3].view(np.float64)[0]), data)
                if time.monotonic() > deadline:
                    raise CommTimeout(f"no consistent copy of rank {target}'s window (group rank) within "
                                      f"{timeout:g} s: it kept being rewritten; raise timeout=", (target,))
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except self._mpi.Exception as e:
            peer = self._ranks[target]
            raise PeerFailure(f"reading the window of rank {peer} (group rank {target}) failed in MPI: {e}",
                              (peer,)) from e

    def free(self) -> None:
        """Release the window. Collective: every member calls it. Idempotent."""
        if self._freed:
            return
        self._freed = True
        self._win.Unlock_all()
        self._win.Free()

    def _check_open(self) -> None:
        if self._freed:
            raise ConfigError("this RMA window was freed (policy closed); create a new policy")
