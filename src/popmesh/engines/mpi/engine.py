"""MPI adapter over mpi4py: COMM_WORLD and sub-communicators, non-blocking calls with timeouts.

Every collective is issued non-blocking (``Iallreduce``…) and polled, so a rank that never arrives
becomes a :class:`~popmesh.core.errors.CommTimeout` instead of a hang. Data-movement collectives move raw
bytes, so every dtype works (bfloat16 included); reductions of float16/bfloat16 run in float32 and
are cast back, since MPI has no half-precision reduction. Buffers live in host memory: a CUDA tensor
is refused with a :class:`~popmesh.core.errors.ConfigError` that names the torch engine
(:mod:`popmesh.engines.mpi.devices`), never copied through the host behind the caller's back.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.core.arrays import is_torch
from popmesh.core.errors import CommTimeout, ConfigError, EngineUnavailable, PeerFailure
from popmesh.core.ops import ReduceOp
from popmesh.engines.base import GroupSpec, SnapshotWindow, Tuning, poll_until, timeout_message
from popmesh.engines.interop import numpy_bytes, torch_bytes
from popmesh.engines.liveness import start_heartbeat
from popmesh.engines.mpi.devices import require_host
from popmesh.engines.mpi.shared_reduce import SHARED_FROM_BYTES, SharedArrays

_NO_REFORM = (
    "an MPI world cannot re-form after a lost rank, nor go on without it: MPI_COMM_WORLD is fixed for the job, and "
    "the fault-tolerance extension that could shrink it (ULFM) is not in the MPICH wheels; use the torch engine "
    "(popmesh launch --max-restarts N) for a world that survives a lost rank, or let popmesh launch --engine mpi "
    "--max-restarts N restart the whole job and resume from a checkpoint (docs/survival.md)"
)

__all__ = ["MpiEngine"]

_DIAG_TAG = 31_999
_FREE_GRACE_S = 2.0  # how long finalize waits for the other members to free a shared window together


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise EngineUnavailable("the mpi engine needs mpi4py and an MPI library: pip install 'popmesh[mpi]'") from e
    return MPI


@dataclass
class _Handle:
    spec: GroupSpec
    comm: Any
    seq: int = 0
    alive: Callable[[], None] | None = None  # raises PeerFailure once the heartbeat found a member failed
    timeout: float = 300.0  # the world's default: for work a call without a timeout must finish first
    shared: SharedArrays | None = None  # where every member is on this node: windows GradientSync borrows
    lazy: list[_LazyShared] = field(default_factory=list)  # started all-reduces that run at their wait


class MpiEngine:
    """Engine over mpi4py's COMM_WORLD."""

    name = "mpi"
    one_sided = True
    generation = 0  # worlds of this engine never re-form
    newcomers: tuple[int, ...] = ()
    tuning = Tuning(cpu_bucket_cap_bytes=4 << 20, max_in_flight=1, reduce_in_backward=False, averages=True)
    """MPICH, measured like gloo's (benchmarks/grad_sync.py --sweep): 4 MiB pieces one after another
    took 0.4x the time of one 40 MB call; larger pieces lose that, smaller ones pay per call. MPI
    progresses only inside MPI calls, and several concurrent non-blocking all-reduces ran 1.2-1.3x
    slower than the same reductions one after another, so one runs at a time. For the same reason
    GradientSync reduces at wait(), not in backward: bucket by bucket in backward, each rank waited
    for the other at every bucket (benchmarks/grad_sync.py's model, 2 ranks, buckets in shared
    windows, interleaved in one run: a training step took 57.7 ms against 54.3 ms reducing at wait();
    a second run 70.2 against 65.0 ms)."""

    @property
    def roster(self) -> tuple[int, ...]:
        """Every rank keeps the launcher's number: these worlds never change size."""
        return tuple(range(self.size))

    def __init__(self) -> None:
        self._mpi = MPI = _import_mpi()
        self._world = MPI.COMM_WORLD
        self._diag = self._world.Dup()
        self.rank: int = self._world.Get_rank()
        self.size: int = self._world.Get_size()
        self._node = self._world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self._node_ranks = frozenset(self._node.Get_group().Translate_ranks(
            list(range(self._node.Get_size())), self._world.Get_group()))
        self._shared: list[_Handle] = []
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN, ReduceOp.PROD: MPI.PROD}
        self._p2p_comm = self._world.Dup()  # point-to-point messages only (mpi_p2p); collective, so made here
        self._credit_comm = self._world.Dup()  # the p2p receivers' credits to their senders (mpi.flow)
        self._comms: list[Any] = [self._diag, self._node, self._p2p_comm, self._credit_comm]
        self._p2p: Any = None
        self._heartbeat = start_heartbeat(self.p2p(), self._peer_failed) if self.size > 1 else None

    def _peer_failed(self, rank: int, error: PeerFailure) -> None:
        """The heartbeat found ``rank`` failed: waits on it raise ``error`` (polling waits see it)."""
        self.p2p().fail_peer(rank, error)

    def _alive_check(self, group: _Handle) -> Callable[[], None] | None:
        """What a collective's wait runs while it sleeps: raise if a member of ``group`` failed."""
        heartbeat = self._heartbeat
        if heartbeat is None:
            return None
        if group.alive is None:
            members = frozenset(group.spec.ranks)

            def alive() -> None:
                error = heartbeat.failure(members)
                if error is not None:
                    where = "the world" if group.spec.gid == 0 else f"group {list(group.spec.ranks)}"
                    raise PeerFailure(f"a collective over {where} cannot complete: {error}", error.ranks)

            group.alive = alive
        return group.alive

    def hostname(self) -> str:
        return socket.gethostname()

    def local_topology(self) -> tuple[int, int]:
        return self._node.Get_rank(), self._node.Get_size()

    def p2p(self) -> Any:
        """Point-to-point frames on global ranks (:class:`~popmesh.engines.mpi.p2p.MpiP2P`), made once."""
        if self._p2p is None:
            from popmesh.engines.mpi.p2p import MpiP2P

            self._p2p = MpiP2P(self)
        return self._p2p

    def make_group(self, spec: GroupSpec, timeout: float) -> Any:
        if spec.gid == 0:
            return self._with_shared(_Handle(spec, self._world, timeout=timeout))
        mpi_group = self._world.Get_group().Incl(list(spec.ranks))
        comm = self._world.Create(mpi_group)
        mpi_group.Free()
        if comm == self._mpi.COMM_NULL:
            return None
        self._comms.append(comm)
        return self._with_shared(_Handle(spec, comm, timeout=timeout))

    def _with_shared(self, group: _Handle) -> _Handle:
        """Give a group whose members all live on this node its shared-memory reducer (every member
        decides alike: each sees the whole group on its node, or each sees a member elsewhere)."""
        if len(group.spec.ranks) > 1 and self._node_ranks.issuperset(group.spec.ranks):
            group.shared = SharedArrays(self._mpi, group.comm, lambda t, what: self._barrier(group, t, what),
                                        lambda a, op, t: self._mpi_all_reduce_(a, op, group, t))
            self._shared.append(group)
        return group

    def lend_shared(self, group: _Handle, sizes: list[int], timeout: float) -> list[np.ndarray] | None:
        """Arrays of ``sizes`` bytes in this member's copy of a new shared window over ``group``
        (collective), or None where the group spans nodes: arrays placed there are reduced in place
        (shared_reduce)."""
        if group.shared is None:
            return None
        self._flush(group)
        return group.shared.lend(sizes, timeout)

    def _in_window(self, group: _Handle, arr: np.ndarray) -> SharedArrays | None:
        """The group's shared arrays where an all-reduce of ``arr`` meets in their header (the same
        answer on every member of a matched call: it depends on the size alone)."""
        shared = group.shared
        return shared if shared is not None and arr.nbytes >= SHARED_FROM_BYTES and shared.lending else None

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce_(self, buf: Any, op: ReduceOp, group: _Handle, timeout: float) -> None:
        if group.lazy:
            self._flush(group, timeout)
        if type(buf) is np.ndarray and buf.dtype.itemsize != 2:
            # The common case (no staging, no widening): small-message latency lives here.
            shared = self._in_window(group, buf)
            if shared is not None:
                shared.all_reduce_(buf, op, timeout)
            else:
                self._mpi_all_reduce_(buf, op, group, timeout)
            return
        arr, finish = self._reducible(buf, "all_reduce")
        shared = self._in_window(group, arr)
        if shared is not None:
            shared.all_reduce_(arr, op, timeout)
        else:
            self._mpi_all_reduce_(arr, op, group, timeout)
        finish(arr)

    def _mpi_all_reduce_(self, arr: np.ndarray, op: ReduceOp, group: _Handle, timeout: float) -> None:
        req = group.comm.Iallreduce(self._mpi.IN_PLACE, arr, op=self._ops[ReduceOp.SUM if op is ReduceOp.AVG else op])
        self._wait(req, group, timeout, "all_reduce")
        if op is ReduceOp.AVG:
            np.divide(arr, group.comm.Get_size(), out=arr)

    def all_reduce_start(self, buf: Any, op: ReduceOp, group: _Handle) -> _MpiPending | _LazyShared:
        arr, finish = self._reducible(buf, "all_reduce_async")
        if self._in_window(group, arr) is not None:
            # MPI would progress it only inside its wait anyway (no progress thread): it runs there,
            # in start order, so that its path is chosen with the other members (shared_reduce).
            pending = _LazyShared(self, group, arr, op, lambda: finish(arr))
            group.lazy.append(pending)
            return pending
        if group.lazy:
            self._flush(group)
        if op is ReduceOp.AVG:  # Tuning.averages: the sum, divided here
            n = group.comm.Get_size()
            req = group.comm.Iallreduce(self._mpi.IN_PLACE, arr, op=self._ops[ReduceOp.SUM])
            return _MpiPending(self, req, group, lambda: finish(np.divide(arr, n, out=arr)))
        req = group.comm.Iallreduce(self._mpi.IN_PLACE, arr, op=self._op(op))
        return _MpiPending(self, req, group, lambda: finish(arr))

    def _flush(self, group: _Handle, timeout: float | None = None, upto: _LazyShared | None = None) -> None:
        """Run the group's started shared all-reduces, oldest first (up to ``upto``), before anything
        else is issued on the group: every member issues its collectives in the same order."""
        while group.lazy:
            pending = group.lazy.pop(0)
            pending.run(group.timeout if timeout is None else timeout)
            if pending is upto:
                return

    def all_gather(self, buf: Any, group: _Handle, timeout: float) -> Any:
        if group.lazy:
            self._flush(group, timeout)
        require_host(buf, "all_gather")
        out = _empty_like_stacked(buf, group.comm.Get_size())
        req = group.comm.Iallgather(_raw(buf), _raw(out))
        self._wait(req, group, timeout, "all_gather")
        return out

    def broadcast_(self, buf: Any, root: int, group: _Handle, timeout: float) -> None:
        if group.lazy:
            self._flush(group, timeout)
        require_host(buf, "broadcast")
        req = group.comm.Ibcast(_raw(buf), root=root)
        self._wait(req, group, timeout, "broadcast")

    def gather(self, buf: Any, root: int, group: _Handle, timeout: float) -> Any:
        if group.lazy:
            self._flush(group, timeout)
        require_host(buf, "gather")
        is_root = group.comm.Get_rank() == root
        out = _empty_like_stacked(buf, group.comm.Get_size()) if is_root else None
        req = group.comm.Igather(_raw(buf), _raw(out) if out is not None else None, root=root)
        self._wait(req, group, timeout, "gather")
        return out

    def reduce_scatter(self, buf: Any, op: ReduceOp, group: _Handle, timeout: float) -> Any:
        if group.lazy:
            self._flush(group, timeout)
        arr, _ = self._reducible(buf, "reduce_scatter")
        n = group.comm.Get_size()
        out = np.empty((arr.shape[0] // n,) + arr.shape[1:], dtype=arr.dtype)
        req = group.comm.Ireduce_scatter_block(arr, out, op=self._op(op))
        self._wait(req, group, timeout, "reduce_scatter")
        return _back_to_kind(out, buf)

    def barrier(self, group: _Handle, timeout: float) -> None:
        if group.lazy:
            self._flush(group, timeout)
        self._barrier(group, timeout, "barrier")

    def _barrier(self, group: _Handle, timeout: float, what: str) -> None:
        self._wait(group.comm.Ibarrier(), group, timeout, what)

    def native_group(self, group: _Handle | None) -> Any:
        """The MPI communicator of ``group`` (``MPI.COMM_NULL`` where this rank is no member)."""
        return self._mpi.COMM_NULL if group is None else group.comm

    require_host = staticmethod(require_host)
    """``require_host(value, what)``: ConfigError where ``value`` is a tensor MPI cannot move (on a
    GPU). Asked by the mechanisms that expose a model in :meth:`snapshot_window`'s host memory."""

    def snapshot_window(self, group: _Handle, nbytes: int) -> SnapshotWindow:
        """An MPI-3 window of ``nbytes`` per member (collective over ``group``): host memory, so a
        model on a GPU is refused before it is exposed (:attr:`require_host`)."""
        from popmesh.engines.mpi.window import MpiSnapshotWindow

        return MpiSnapshotWindow(self._mpi, group, nbytes)

    def peer_failure(self, ranks: Collection[int] | None = None) -> PeerFailure | None:
        """A member of ``ranks`` (None: any rank) the heartbeat found frozen or dead, as a PeerFailure."""
        return None if self._heartbeat is None else self._heartbeat.failure(ranks)

    def reform(self, timeout: float) -> tuple[int, ...]:
        """MPI cannot re-form a world that lost a rank without ULFM (MPIX_Comm_shrink), which the MPICH
        wheels do not build: a clear error instead of a hang."""
        raise ConfigError(_NO_REFORM)

    def try_reform(self, timeout: float) -> tuple[int, ...] | None:
        return self.reform(timeout)  # the same clear error: an MPI world never re-forms

    def newcomer_waiting(self) -> bool:
        return False  # nothing restarts a lost MPI rank

    def settle(self) -> None:
        return None  # a world that never re-forms has no newcomers

    def survivors(self, gid: int, timeout: float) -> tuple[tuple[int, ...], Any]:
        """No survivors' group either: without ULFM, MPI cannot make a communicator that leaves a dead rank out."""
        raise ConfigError(_NO_REFORM)

    def finalize(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()  # says bye first: its successor stops watching
        if self._p2p is not None:
            self._p2p.close()  # sends in flight complete before their communicator goes
        self._free_shared()
        for comm in reversed(self._comms):
            if comm != self._mpi.COMM_NULL:
                comm.Free()
        self._comms = []

    def _free_shared(self) -> None:
        """Free the shared windows where every member is here to free them too (freeing is collective):
        a short barrier decides; past it, or with a member lost, the window goes with the process."""
        for group in self._shared:
            if group.shared is None or not group.shared.lending:
                continue
            try:
                if self.peer_failure(group.spec.ranks) is None:
                    self._barrier(group, _FREE_GRACE_S, "finalize")
                    group.shared.free()
            except (CommTimeout, PeerFailure):
                pass
        self._shared = []

    # ---- helpers -----------------------------------------------------------------------------
    def _op(self, op: ReduceOp) -> Any:
        return self._ops[op]

    def _reducible(self, buf: Any, what: str) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
        """A numpy array MPI can reduce, and how to write the result back into ``buf`` (``what``: the
        call, named where ``buf`` is refused for living on a GPU)."""
        if type(buf) is np.ndarray and buf.dtype.itemsize != 2:
            return buf, _noop  # the common case, decided without numpy's slow dtype.name (the guard's words)
        if is_torch(buf):
            require_host(buf, what)
            if buf.dtype.is_floating_point and buf.element_size() == 2:
                return buf.detach().float().numpy(), lambda a: buf.copy_(_torch_from(a, buf))
            return buf.numpy(), _noop
        if buf.dtype == np.float16 or buf.dtype.name == "bfloat16":
            wide = buf.astype(np.float32)
            return wide, lambda a: np.copyto(buf, a.astype(buf.dtype))
        return buf, _noop

    def _wait(self, req: Any, group: _Handle, timeout: float, what: str) -> None:
        group.seq += 1
        p2p = self._p2p
        test = req.Test if p2p is None or not p2p._deferred else _pumping(p2p, req)
        try:
            finished = poll_until(test, timeout, idle=self._alive_check(group))
        except self._mpi.Exception as e:
            raise PeerFailure(f"{what} failed in MPI: {e}", self._peers(group), exact=False) from e
        if not finished:
            missing = self._missing_ranks(group, timeout)
            raise CommTimeout(timeout_message(what, timeout, group.spec, missing), missing)

    def _peers(self, group: _Handle) -> list[int]:
        """The other members of ``group`` (global ranks): the suspects when MPI cannot name a failed peer."""
        return [r for r in group.spec.ranks if r != self.rank] or [self.rank]

    def _missing_ranks(self, group: _Handle, timeout: float) -> tuple[int, ...] | None:
        """Tell every member 'I reached collective #seq' and listen briefly for the same from others."""
        try:
            me = np.array([group.spec.gid, group.seq], dtype=np.int64)
            others = [r for r in group.spec.ranks if r != self.rank]
            sends = [self._diag.Isend(me, dest=r, tag=_DIAG_TAG) for r in others]
            heard = self._listen(group, set(others), min(2.0, max(0.5, timeout)))
            for req in sends:
                if not req.Test():
                    req.Cancel()
            return tuple(r for r in others if r not in heard)
        except Exception:
            return None

    def _listen(self, group: _Handle, expected: set[int], grace: float) -> set[int]:
        heard: set[int] = set()
        status = self._mpi.Status()
        deadline = time.monotonic() + grace
        note = np.empty(2, dtype=np.int64)
        while heard != expected and time.monotonic() < deadline:
            if self._diag.Iprobe(source=self._mpi.ANY_SOURCE, tag=_DIAG_TAG, status=status):
                self._diag.Recv(note, source=status.Get_source(), tag=_DIAG_TAG)
                if int(note[0]) == group.spec.gid and int(note[1]) == group.seq:
                    heard.add(status.Get_source())
            else:
                time.sleep(0.01)
        return heard


class _MpiPending:
    """An Iallreduce in flight; Test() both polls and drives MPI's progress."""

    def __init__(self, engine: MpiEngine, req: Any, group: _Handle, complete: Callable[[], None]) -> None:
        self._engine, self._req, self._group, self._complete = engine, req, group, complete
        self._finished = False

    def done(self) -> bool:
        return self._finished or bool(self._req.Test())

    def wait(self, timeout: float) -> None:
        if self._finished:
            return
        self._engine._wait(self._req, self._group, timeout, "all_reduce")
        self._complete()
        self._finished = True


class _LazyShared:
    """An all-reduce on a lending group, started: it runs when it (or a later call of the group) waits."""

    def __init__(self, engine: MpiEngine, group: _Handle, arr: np.ndarray, op: ReduceOp,
                 complete: Callable[[], None]) -> None:
        self._engine, self._group, self._arr, self._op, self._complete = engine, group, arr, op, complete
        self._finished = False

    def done(self) -> bool:
        return self._finished

    def wait(self, timeout: float) -> None:
        if not self._finished:
            self._engine._flush(self._group, timeout, upto=self)

    def run(self, timeout: float) -> None:
        assert self._group.shared is not None
        self._group.shared.all_reduce_(self._arr, self._op, timeout)
        self._complete()
        self._finished = True


def _noop(_: Any) -> None:
    return None


def _pumping(p2p: Any, req: Any) -> Callable[[], bool]:
    """``req.Test``, posting the point-to-point frames that wait for room at their receivers on each
    call: MPI progresses sends in any MPI call, so popmesh's waits do the same (mpi.flow)."""

    def test() -> bool:
        p2p._pump()
        return bool(req.Test())

    return test


def _raw(buf: Any) -> np.ndarray:
    """The bytes of a numpy array or CPU tensor (mpi4py splits a receive buffer evenly per rank)."""
    return torch_bytes(buf) if is_torch(buf) else numpy_bytes(buf)


def _empty_like_stacked(buf: Any, n: int) -> Any:
    if is_torch(buf):
        import torch

        return torch.empty((n,) + tuple(buf.shape), dtype=buf.dtype)
    return np.empty((n,) + buf.shape, dtype=buf.dtype)


def _torch_from(a: np.ndarray, like: Any) -> Any:
    import torch

    return torch.from_numpy(a).to(dtype=like.dtype, device=like.device)


def _back_to_kind(out: np.ndarray, like: Any) -> Any:
    if is_torch(like):
        return _torch_from(out, like)
    if out.dtype != like.dtype:
        return out.astype(like.dtype)
    return out
