"""torch.distributed adapter: gloo on CPU, nccl for CUDA tensors when CUDA is present.

Rendezvous uses a TCPStore on MASTER_ADDR:MASTER_PORT (127.0.0.1 by default). Under
``popmesh launch`` rank 0 receives an already-listening socket (``POPMESH_STORE_FD``), so ranks that
start first wait in the kernel's backlog instead of torch's client back-off (which made a 4-rank
world take 400+ ms to form instead of ~20 ms). A world that cannot form fails within the timeout
(:mod:`popmesh.engines.torch.rendezvous`).

A collective that gloo fails with a closed connection raises PeerFailure naming the peers whose
connection is closed, found with a zero-byte send to each peer of the group (gloo refuses one to a
closed connection at once); ``exact=False`` with every peer as a suspect when none can be told apart.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import numpy as np

from popmesh.core.errors import CommTimeout, ConfigError, EngineUnavailable, PeerFailure, PopmeshError
from popmesh.core.launch_env import TorchEnv
from popmesh.core.ops import ReduceOp
from popmesh.engines.base import GroupSpec, SnapshotWindow, Tuning, timeout_message
from popmesh.engines.interop import numpy_to_torch, torch_to_numpy
from popmesh.engines.liveness import Heartbeat, start_heartbeat
from popmesh.engines.torch.generations import (
    await_node,
    mark_formed,
    newcomer_attempt,
    refuse_joiner,
    register_joiner,
    start_counting,
)
from popmesh.engines.torch.network import pin_interface
from popmesh.engines.torch.pumps import CLOSE_TAG, CLOSE_WAIT
from popmesh.engines.torch.reforming import GroupHandle, Reforming
from popmesh.engines.torch.rendezvous import join_world, make_store
from popmesh.engines.torch.send import is_gone

__all__ = ["TorchEngine"]

_NARROW_INTS: tuple[Any, ...] = ()
_KEEP_FINISHED_WORKS = 4
_PROBE_TAG = (1 << 20) - 2  # a gloo tag no one receives on (below the point-to-point transport's tags)
_PROBE_WAITS_S = (0.0, 0.05, 0.2)


def _import_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise EngineUnavailable(
            "the torch engine needs PyTorch: pip install 'popmesh[torch]' (CPU build: pip install torch==2.13.0)"
        ) from e
    if not dist.is_available():
        raise EngineUnavailable("this PyTorch build has no torch.distributed: install a standard build")
    return dist


class TorchEngine(Reforming):
    """Engine over torch.distributed. Adopts an existing default process group if one exists."""

    name = "torch"
    one_sided = False
    tuning = Tuning(cpu_bucket_cap_bytes=16 << 20, max_in_flight=0, overlap_from_bytes=8 << 20)
    """gloo, measured on a 2-vCPU box with 2 ranks and a 40 MB model (benchmarks/grad_sync.py --sweep,
    docs/performance.md): 16 MiB buckets, all in flight, came closest to one flat call; below 4 MiB
    its ~0.3 ms per call shows, and its background threads gain from having every bucket queued.
    A one-element all-reduce issued beside a 4 B one took 3x as long as one issued before it, so the
    mismatch guard of a blocking call runs first; from 8 MiB up the payload's transfer hides it (16 MB:
    0.99x unguarded beside, 1.08x first; 1 MB: 1.26x beside, 1.18x first)."""

    def __init__(self, env: TorchEnv, timeout: float, backend: str | None = None,
                 fingerprint: str | None = None) -> None:
        import torch

        self._torch = torch
        global _NARROW_INTS
        _NARROW_INTS = _narrow_ints()
        self._dist = dist = _import_dist()
        self._env = env
        self._owns = not dist.is_initialized()
        self._store: Any = None
        self._p2p: Any = None
        # The last few completed works stay referenced by the main thread: gloo's worker thread drops
        # its own reference a moment after the waiter returns, and if that is the last one, the work
        # is freed on the worker, which needs the GIL for the Python state it captured. If the
        # interpreter is shutting down by then, the process aborts ("terminate called without an
        # active exception"; about 1 exit in 10 without them). A few suffice (the worker is long done
        # with older ones); more would keep large collectives' tensors alive. See finalize().
        self._finished_works: deque[Any] = deque(maxlen=_KEEP_FINISHED_WORKS)
        self._probes: list[Any] = []  # zero-byte sends to live peers stay posted: never freed mid-flight
        self._groups: list[GroupHandle] = []  # the subgroups this rank is a member of
        self._heartbeat: Heartbeat | None = None
        self.generation = 0  # which forming of the world this process is in (see reform)
        self.newcomers: tuple[int, ...] = ()  # ranks that joined the current generation as new processes
        self.roster: tuple[int, ...] = tuple(range(env.world_size))  # the launcher's slot of each rank
        self._left = False  # left a generation that lost a rank, not yet in the next one (try_reform)
        self._hole: frozenset[int] = frozenset()  # the lost ranks of this generation's survivors' group
        self._left_seen = 0  # slots marked left when this generation formed (elastic worlds)
        self._unsettled = False  # joined as a new process, and no world formed on it yet (settle)
        self._unfinished = False  # a collective failed here (timed out, a peer gone): gloo may still run it
        _pick_cuda_device(torch, env)
        if self._owns:
            self._store = make_store(dist, env, timeout)
            self.backend: str = backend or _default_backend(torch)
            elastic = env.min_nodes is not None
            if (env.restart_count > 0 and (env.world_size > 1 or elastic)) or env.joining:  # join the next generation
                pin_interface(env)  # as join_world does: on another host, gloo must listen where the others reach
                with self._store_lost_says_so():  # node 0's launcher ended while this process came to join
                    attempt = newcomer_attempt(self._store, env.rank, timeout)
                    if env.joining and env.restart_count == 0:
                        refuse_joiner(self._store, env.rank, env.local_world_size, fingerprint)
                        register_joiner(self._store, env.rank)
                        await_node(self._store, env.rank, env.local_world_size or 1, time.monotonic() + timeout)
                    self._join_generation(attempt, timeout, fresh=True)
            else:
                join_world(dist, self._store, env, self.backend, timeout)
                if env.world_size > 1 or elastic:  # it may re-form (an elastic world of one may grow)
                    start_counting(self._store, env.world_size, env.local_world_size, fingerprint)
                    mark_formed(self._store, 0)
        else:
            self.backend = str(dist.get_backend())
        self.rank: int = dist.get_rank()
        self.size: int = dist.get_world_size()
        self._stage_cuda = "nccl" not in self.backend
        ops = dist.ReduceOp
        self._ops = {ReduceOp.SUM: ops.SUM, ReduceOp.MAX: ops.MAX, ReduceOp.MIN: ops.MIN, ReduceOp.PROD: ops.PRODUCT}
        self._timedeltas: dict[float, timedelta] = {}
        self._all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if self.size > 1:
            self._heartbeat = start_heartbeat(self.p2p(), self._peer_failed)

    def hostname(self) -> str:
        return socket.gethostname()

    def local_topology(self) -> tuple[int, int] | None:
        if self._env.local_rank is not None and self._env.local_world_size is not None:
            return self._env.local_rank, self._env.local_world_size
        return None

    def p2p(self) -> Any:
        """Point-to-point frames on global ranks (:class:`~popmesh.engines.torch.p2p.TorchP2P`), made once."""
        if self._p2p is None:
            if self._left:
                raise ConfigError("this rank left its generation of the world after a lost rank and is not in "
                                  "the next one yet: call world.try_reform() until it returns (or world.reform()) "
                                  "before any message")
            from popmesh.engines.torch.p2p import TorchP2P

            self._p2p = TorchP2P(self)
        return self._p2p

    def make_group(self, spec: GroupSpec, timeout: float) -> Any:
        if spec.gid == 0:
            return GroupHandle(spec, None)
        pg = self._dist.new_group(list(spec.ranks), timeout=timedelta(seconds=timeout))
        if self.rank not in spec.ranks:
            return None
        handle = GroupHandle(spec, pg)
        self._groups.append(handle)
        return handle

    # ---- failures found by the heartbeat ------------------------------------------------------
    def peer_failure(self, ranks: Collection[int] | None = None) -> PeerFailure | None:
        """A member of ``ranks`` (None: any rank) the heartbeat found frozen or dead, as a PeerFailure."""
        return None if self._heartbeat is None else self._heartbeat.failure(ranks)

    def _peer_failed(self, rank: int, error: PeerFailure) -> None:
        """The heartbeat found ``rank`` failed: close gloo's connections to it (in the world and every
        group with it), so whatever waits on it in gloo, a collective included, fails now."""
        self.p2p().fail_peer(rank, error)  # the world's connection, and point-to-point waits
        empty = self._torch.empty(0, dtype=self._torch.uint8)
        for handle in self._groups:
            if rank in handle.spec.ranks:
                try:
                    handle.pg.recv([empty], handle.spec.group_rank(rank), CLOSE_TAG).wait(CLOSE_WAIT)
                except RuntimeError:
                    pass  # the expected outcome: gloo closed the connection when the receive timed out

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce_(self, buf: Any, op: ReduceOp, group: GroupHandle, timeout: float) -> None:
        if type(buf) is not np.ndarray and buf.dtype not in _NARROW_INTS and not (self._stage_cuda and buf.is_cuda):
            # The common case, without staging or widening: small-message latency lives here.
            work = self._dist.all_reduce(buf, op=self._ops[op], group=group.pg, async_op=True)
            self._wait(work, group, timeout, "all_reduce")
            return
        self.all_reduce_start(buf, op, group).wait(timeout)

    def all_reduce_start(self, buf: Any, op: ReduceOp, group: GroupHandle) -> _TorchPending:
        t, finish = self._prepare(buf)
        wide = self._widen(t, op)
        work = self._dist.all_reduce(wide, op=self._op(op), group=group.pg, async_op=True)

        def complete() -> None:
            if wide is not t:
                t.copy_(wide)
            finish(t)

        return _TorchPending(self, work, group, complete)

    def all_gather(self, buf: Any, group: GroupHandle, timeout: float) -> Any:
        t, _ = self._prepare(buf)
        n = len(group.spec.ranks)
        out = self._torch.empty((n,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        work = self._all_gather_single(_bytes(out), _bytes(t), group=group.pg, async_op=True)
        self._wait(work, group, timeout, "all_gather")
        return self._restore(out, buf)

    def broadcast_(self, buf: Any, root: int, group: GroupHandle, timeout: float) -> None:
        t, finish = self._prepare(buf)
        work = self._dist.broadcast(_bytes(t), src=group.spec.ranks[root], group=group.pg, async_op=True)
        self._wait(work, group, timeout, "broadcast")
        finish(t)

    def gather(self, buf: Any, root: int, group: GroupHandle, timeout: float) -> Any:
        t, _ = self._prepare(buf)
        n = len(group.spec.ranks)
        is_root = group.spec.ranks[root] == self.rank
        out = self._torch.empty((n,) + tuple(t.shape), dtype=t.dtype, device=t.device) if is_root else None
        targets = [_bytes(row) for row in out.unbind(0)] if out is not None else None
        work = self._dist.gather(_bytes(t), targets, dst=group.spec.ranks[root], group=group.pg, async_op=True)
        self._wait(work, group, timeout, "gather")
        return self._restore(out, buf) if out is not None else None

    def reduce_scatter(self, buf: Any, op: ReduceOp, group: GroupHandle, timeout: float) -> Any:
        t, _ = self._prepare(buf)
        t = self._widen(t, op)
        n = len(group.spec.ranks)
        out = self._torch.empty((t.shape[0] // n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = self._reduce_scatter_single(out, t, op=self._op(op), group=group.pg, async_op=True)
        self._wait(work, group, timeout, "reduce_scatter")
        return self._restore(out.to(_dtype_of(buf)), buf)

    def barrier(self, group: GroupHandle, timeout: float) -> None:
        work = self._dist.barrier(group=group.pg, async_op=True)
        self._wait(work, group, timeout, "barrier")

    def native_group(self, group: GroupHandle | None) -> Any:
        """The torch ProcessGroup of ``group`` (torch's non-member sentinel where this rank is none)."""
        if group is None:
            return self._dist.GroupMember.NON_GROUP_MEMBER
        return group.pg if group.pg is not None else self._dist.group.WORLD

    def snapshot_window(self, group: GroupHandle, nbytes: int) -> SnapshotWindow:
        """No one-sided windows on this engine (``one_sided`` is False)."""
        raise ConfigError(f"the {self.name} engine has no one-sided windows: launch under mpiexec or "
                          "popmesh.init(engine='mpi')")

    def _all_groups(self) -> list[tuple[tuple[int, ...], Any]]:
        """(global ranks, process group) of the world and of every group this rank is a member of."""
        return [(tuple(range(self.size)), self._dist.group.WORLD)] + [(h.spec.ranks, h.pg) for h in self._groups]

    def _close_connections(self, groups: list[tuple[tuple[int, ...], Any]]) -> None:
        """Close this rank's gloo connections in ``groups`` (global ranks, process group): whatever waits
        on them there, on this rank or its peers, fails at once."""
        if "gloo" not in self.backend:
            return
        empty = self._torch.empty(0, dtype=self._torch.uint8)
        for ranks, pg in groups:
            for peer in (i for i, r in enumerate(ranks) if r != self.rank):
                try:  # a receive that times out closes every connection of this gloo context
                    pg.recv([empty], peer, CLOSE_TAG).wait(CLOSE_WAIT)
                except RuntimeError:
                    pass  # timed out (all closed now: the next fail at once), or that peer was gone already

    def _stop_transport(self, grace: float | None = None, *, forget: bool = True) -> None:
        """Stop the heartbeat (it says bye first: its successor stops watching), then the point-to-point
        transport (before the group goes: no receive may be left waiting on it); unless finalizing
        (``forget`` False: later calls meet the closed transport), the next generation or the
        survivors' group makes its own. ``grace``: how long pending sends may take."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._p2p is not None:
            if grace is None:
                self._p2p.close()
            else:
                self._p2p.close(grace)
        if forget:
            self._heartbeat = self._p2p = None

    def finalize(self) -> None:
        self._stop_transport(forget=False)
        if self._owns and self._dist.is_initialized():
            if self._unfinished:  # gloo's worker still runs the failed collective: destroying the group
                self._close_connections(self._all_groups())  # would wait for it (5 s at exit, measured)
            self._dist.destroy_process_group()
        self._store = None
        if self._finished_works:
            self._finished_works.clear()
            time.sleep(0.02)  # without the GIL: a worker still finishing with one of them frees it now

    # ---- helpers -----------------------------------------------------------------------------
    def _op(self, op: ReduceOp) -> Any:
        return self._ops[op]

    def _widen(self, t: Any, op: ReduceOp) -> Any:
        """gloo reduces no 16-bit or unsigned integers beyond uint8: reduce those in int64."""
        if t.dtype not in _NARROW_INTS:
            return t
        if op in (ReduceOp.MAX, ReduceOp.MIN) and t.dtype == self._torch.uint64:
            raise ConfigError("gloo cannot take the MAX/MIN of uint64: use int64 or the mpi engine")
        return t.to(self._torch.int64)

    def _prepare(self, buf: Any) -> tuple[Any, Callable[[Any], None]]:
        """A tensor the backend accepts, and how to write the result back into ``buf``."""
        if isinstance(buf, np.ndarray):
            return numpy_to_torch(buf), _noop
        if buf.is_cuda and self._stage_cuda:
            return buf.cpu(), buf.copy_
        return buf, _noop

    def _restore(self, out: Any, like: Any) -> Any:
        if isinstance(like, np.ndarray):
            return torch_to_numpy(out, like)
        return out.to(like.device) if out.device != like.device else out

    def _wait(self, work: Any, group: GroupHandle, timeout: float, what: str) -> None:
        group.seq += 1
        span = self._timedeltas.get(timeout)
        if span is None:
            span = self._timedeltas[timeout] = timedelta(seconds=timeout)
        try:
            work.wait(span)
        except RuntimeError as e:
            self._raise(e, group, timeout, what)
        self._finished_works.append(work)

    def _raise(self, e: RuntimeError, group: GroupHandle, timeout: float, what: str) -> None:
        self._unfinished = True
        text = str(e)
        failure = self.peer_failure(group.spec.ranks)
        if failure is not None:  # the heartbeat closed the connection to a frozen or dead member
            raise PeerFailure(f"{what} cannot complete: {failure}", failure.ranks) from e
        if "timed out" in text.lower() or "timeout" in text.lower():
            missing = self._missing_ranks(group, timeout)
            raise CommTimeout(timeout_message(what, timeout, group.spec, missing), missing) from e
        if is_gone(e):
            raise self._peer_failure(what, group, text) from e
        raise PopmeshError(
            f"{what} failed in torch.distributed: {text}. If ranks passed different shapes or dtypes, "
            "POPMESH_CHECK=1 reports each rank's values."
        ) from e

    def _peer_failure(self, what: str, group: GroupHandle, text: str) -> PeerFailure:
        """The PeerFailure of a collective gloo failed with a closed connection, naming the peers whose
        connection is closed. gloo's text names only an address; when no peer can be told apart, every
        peer of the group is a suspect (``exact=False``)."""
        peers = [r for r in group.spec.ranks if r != self.rank]
        for wait in _PROBE_WAITS_S:
            time.sleep(wait)
            dead = self._closed_peers(group, peers)
            if dead:
                return PeerFailure(f"{what}: rank(s) {dead} closed their connection (did they die?): {text}", dead)
        suspects = peers or [self.rank]
        return PeerFailure(f"{what}: a peer closed its connection, but no peer of {suspects} could be told apart "
                           f"(all are suspects; did a rank die?): {text}", suspects, exact=False)

    def _closed_peers(self, group: GroupHandle, peers: list[int]) -> list[int]:
        """The ``peers`` whose connection in ``group`` is closed: gloo refuses a zero-byte send to one at
        once, and leaves one to a live peer posted (kept, and never received: harmless)."""
        pg = group.pg if group.pg is not None else self._dist.group.WORLD
        if pg is None:  # the world was finalized meanwhile
            return []
        empty = self._torch.empty(0, dtype=self._torch.uint8)
        dead = []
        for rank in peers:
            try:
                self._probes.append(pg.send([empty], group.spec.group_rank(rank), _PROBE_TAG))
            except RuntimeError as e:
                if is_gone(e):
                    dead.append(rank)
        return dead

    def _missing_ranks(self, group: GroupHandle, timeout: float) -> tuple[int, ...] | None:
        """Ask the store which ranks reached this collective: each timed-out rank leaves a mark."""
        if self._store is None:
            return None
        prefix = f"popmesh/arrived/{group.spec.gid}/{group.seq}/"
        try:
            self._store.set(prefix + str(self.rank), b"1")
            deadline = time.monotonic() + min(2.0, max(0.5, timeout))
            while True:
                arrived = {r for r in group.spec.ranks if self._store.check([prefix + str(r)])}
                if len(arrived) == len(group.spec.ranks) or time.monotonic() > deadline:
                    return tuple(r for r in group.spec.ranks if r not in arrived)
                time.sleep(0.05)
        except Exception:  # the store host may be the rank that died
            return None


class _TorchPending:
    """An all_reduce in flight on torch.distributed."""

    def __init__(self, engine: TorchEngine, work: Any, group: GroupHandle, complete: Callable[[], None]) -> None:
        self._engine, self._work, self._group, self._complete = engine, work, group, complete
        self._finished = False

    def done(self) -> bool:
        return self._finished or bool(self._work.is_completed())

    def wait(self, timeout: float) -> None:
        if self._finished:
            return
        self._engine._wait(self._work, self._group, timeout, "all_reduce")
        self._complete()
        self._finished = True


def _noop(_: Any) -> None:
    return None


def _bytes(t: Any) -> Any:
    """Raw bytes of a contiguous tensor: data movement is dtype-agnostic (gloo lacks int16 etc.)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def _dtype_of(buf: Any) -> Any:
    return numpy_to_torch(buf[:0].reshape(-1)).dtype if isinstance(buf, np.ndarray) else buf.dtype


def _narrow_ints() -> tuple[Any, ...]:
    import torch

    return tuple(getattr(torch, name) for name in ("int16", "uint16", "uint32", "uint64") if hasattr(torch, name))


def _pick_cuda_device(torch: Any, env: TorchEnv) -> None:
    """One GPU per local rank, as torchrun users expect: ``cuda:LOCAL_RANK`` becomes the current device
    (before nccl binds its communicators to it). Nothing without CUDA or a LOCAL_RANK."""
    if env.local_rank is not None and torch.cuda.is_available() and env.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(env.local_rank)


def backend_for_host(cuda_available: bool, nccl_available: bool) -> str:
    """The default group's backend for a host described by the two flags: gloo for CPU tensors, and
    nccl for CUDA tensors where the host has both (so GradientSync and the collectives run CUDA
    tensors on nccl). Code that insists on exactly ``"gloo"`` asks for ``init(backend="gloo")``, as
    the GFlowNet facade in ``popmesh.compat`` does."""
    return "cpu:gloo,cuda:nccl" if cuda_available and nccl_available else "gloo"


def _default_backend(torch: Any) -> str:
    return backend_for_host(torch.cuda.is_available(), torch.distributed.is_nccl_available())
