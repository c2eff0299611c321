"""The one Protocol every engine adapter implements, and the pieces adapters share.

Adapters receive *contiguous* numpy arrays or torch tensors (the collectives layer prepares them),
global ranks are translated to group ranks above this layer, and AVG/bool reductions are reduced to
SUM/MAX/MIN/PROD before they get here. Every blocking method takes ``timeout`` in seconds and raises
:class:`~popmesh.core.errors.CommTimeout` (naming the ranks that did not arrive where it can tell) or
:class:`~popmesh.core.errors.PeerFailure` instead of hanging.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from popmesh.core.errors import PeerFailure
from popmesh.core.handles import Pending
from popmesh.core.ops import ReduceOp

__all__ = [
    "GroupSpec", "Engine", "Tuning", "Snapshot", "SnapshotWindow", "poll_until", "timeout_message",
]


@dataclass(frozen=True)
class GroupSpec:
    """A communicator over ``ranks`` (global ranks, in group-rank order); ``gid`` 0 is the world."""

    gid: int
    ranks: tuple[int, ...]

    def group_rank(self, global_rank: int) -> int:
        """Position of ``global_rank`` in this group."""
        return self.ranks.index(global_rank)


@dataclass(frozen=True)
class Tuning:
    """Measured defaults an engine hands to the layers above, so they never branch on its name.

    ``cpu_bucket_cap_bytes``: gradient-bucket size for CPU tensors (None: DDP's 25 MiB).
    ``max_in_flight``: how many bucket reductions may run at once (0: all).
    ``overlap_from_bytes``: from which payload size a small collective issued beside another on the
    same group costs less than one issued before it (the mismatch guard of popmesh.comm.guard asks).
    ``reduce_in_backward``: whether GradientSync(overlap=True) starts bucket reductions during
    backward (False: its hooks only move gradients into the buckets, and wait() reduces them; for
    engines that make no progress between their calls, where a reduction started in backward only
    makes the ranks wait for each other bucket by bucket).
    ``averages``: ``all_reduce_start`` takes ``ReduceOp.AVG`` for float32/float64 buffers (the sum
    divided by the group size, to the bit as dividing afterwards would give).
    """

    cpu_bucket_cap_bytes: int | None = None
    max_in_flight: int = 0
    overlap_from_bytes: int = 0
    reduce_in_backward: bool = True
    averages: bool = False


@dataclass
class Snapshot:
    """A consistent copy of a peer's latest publication in a :class:`SnapshotWindow`."""

    iteration: int
    metric: float
    data: Any  # a flat uint8 numpy array


class SnapshotWindow(Protocol):
    """One-sided memory over a group: each member publishes a byte snapshot, any member reads any
    other's without the owner's help. Creation and :meth:`free` are collective; targets are group ranks."""

    def publish(self, payload: Any, iteration: int, metric: float) -> None: ...
    def read(self, target: int, timeout: float, with_data: bool = True) -> Snapshot | None: ...
    def free(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """What popmesh needs from torch.distributed, MPI or a world of one."""

    name: str
    rank: int
    size: int
    one_sided: bool  # whether :meth:`snapshot_window` is available
    generation: int  # how many times the world re-formed after a lost rank (see reform)
    newcomers: tuple[int, ...]  # ranks that joined the current generation as new processes
    tuning: Tuning

    @property
    def roster(self) -> tuple[int, ...]: ...  # the launcher's number (RANK) of each rank: kept across re-forms

    def hostname(self) -> str: ...
    def local_topology(self) -> tuple[int, int] | None: ...  # (local rank, size); None: World compares hostnames
    def make_group(self, spec: GroupSpec, timeout: float) -> Any: ...
    def p2p(self) -> Any: ...
    def all_reduce_(self, buf: Any, op: ReduceOp, group: Any, timeout: float) -> None: ...
    def all_reduce_start(self, buf: Any, op: ReduceOp, group: Any) -> Pending: ...
    def all_gather(self, buf: Any, group: Any, timeout: float) -> Any: ...
    def broadcast_(self, buf: Any, root: int, group: Any, timeout: float) -> None: ...
    def gather(self, buf: Any, root: int, group: Any, timeout: float) -> Any: ...
    def reduce_scatter(self, buf: Any, op: ReduceOp, group: Any, timeout: float) -> Any: ...
    def barrier(self, group: Any, timeout: float) -> None: ...
    def snapshot_window(self, group: Any, nbytes: int) -> SnapshotWindow: ...
    def native_group(self, group: Any) -> Any: ...  # the engine's own communicator for a group handle
    def peer_failure(self, ranks: Collection[int] | None = None) -> PeerFailure | None: ...  # the heartbeat's finding
    def reform(self, timeout: float) -> tuple[int, ...]: ...  # next generation after a lost rank; its new processes
    def try_reform(self, timeout: float) -> tuple[int, ...] | None: ...  # the same, None until a newcomer waits
    def survivors(self, gid: int, timeout: float) -> tuple[tuple[int, ...], Any]: ...  # live ranks, their group
    def newcomer_waiting(self) -> bool: ...  # a restarted process waits to join (reform() would not wait for it)
    def settle(self) -> None: ...  # the world formed on this generation: its newcomers are members like the rest
    def finalize(self) -> None: ...


def poll_until(done: Callable[[], bool], timeout: float, spin_s: float = 0.05,
               idle: Callable[[], None] | None = None) -> bool:
    """Poll ``done`` until it is true or ``timeout`` passes: spin first, then back off to 1 ms sleeps.

    Spinning keeps latency at the engine's floor (MPI's own blocking calls spin too); after
    ``spin_s`` the wait is long anyway, and sleeping stops a waiting rank from stealing a core from
    ranks that still compute. A 1 ms wake-up granularity costs < 2 % of such a wait. ``idle`` runs
    once per sleep (it may raise to end the wait, e.g. when the heartbeat found a peer failed).
    """
    start = time.perf_counter()
    spin_until = start + min(spin_s, timeout)
    polls = 0
    while True:
        if done():
            return True
        polls += 1
        if polls % 32 == 0:
            if time.perf_counter() >= spin_until:
                break
            os.sched_yield()  # with more ranks than cores, let a descheduled peer run
    pause = 1e-4
    deadline = start + timeout
    while True:
        if done():
            return True
        now = time.perf_counter()
        if now >= deadline:
            return False
        if idle is not None:
            idle()
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)


def timeout_message(what: str, timeout: float, spec: GroupSpec, missing: tuple[int, ...] | None) -> str:
    """One wording for every engine's timeout."""
    where = f"group {list(spec.ranks)}" if spec.gid else "the world"
    if missing:
        who = f"ranks {list(missing)} did not arrive"
    elif missing is None:
        who = "the engine cannot tell which ranks are missing"
    else:
        who = "every rank arrived but the operation did not finish (a mismatched collective?)"
    return (
        f"{what} on {where} timed out after {timeout:g} s: {who}. Check that every rank calls the "
        "same collectives in the same order, or raise the timeout (timeout=..., POPMESH_TIMEOUT)."
    )
