"""Re-forming a torch world after a lost rank: the survivors' side of ``world.reform()``,
``try_reform()``, ``newcomer_waiting()`` and ``survivors()`` (docs/survival.md).

:class:`Reforming` is a part of :class:`~popmesh.engines.torch.engine.TorchEngine`, kept apart so the
engine's module holds the collectives: it leaves a generation (its transport, heartbeat, connections
and process groups), joins the next one over the same store, and forms the survivors' own group while
the lost ranks restart. The pure decisions live in :mod:`~popmesh.engines.torch.generations` and
:mod:`~popmesh.engines.torch.holes`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from popmesh.core.errors import CommTimeout, ConfigError, PeerFailure, PopmeshError
from popmesh.core.launch_env import TorchEnv
from popmesh.engines.base import GroupSpec
from popmesh.engines.liveness import Heartbeat, start_heartbeat
from popmesh.engines.torch.generations import (
    ATTEMPT,
    left_count,
    newcomer_waiting,
    newcomers,
    next_attempt,
    restarted_ranks,
)
from popmesh.engines.torch.holes import agree_survivors
from popmesh.engines.torch.rendezvous import join_generation, store_lost

__all__ = ["GroupHandle", "Reforming"]

_SURVIVORS_GRACE_S = 5.0  # how long survivors forming their group give their pending sends to complete


@dataclass
class GroupHandle:
    """A process group of the torch engine and its spec."""

    spec: GroupSpec
    pg: Any
    seq: int = 0


class Reforming:
    """The re-forming part of the torch engine; the engine provides the state declared here."""

    name: str
    rank: int
    size: int
    backend: str
    generation: int
    newcomers: tuple[int, ...]
    roster: tuple[int, ...]
    _dist: Any
    _env: TorchEnv
    _owns: bool
    _store: Any
    _p2p: Any
    _heartbeat: Heartbeat | None
    _groups: list[GroupHandle]
    _probes: list[Any]
    _finished_works: deque[Any]
    _left: bool
    _hole: frozenset[int]
    _left_seen: int  # slots marked left when this generation formed (elastic worlds)

    # the engine's methods this part calls
    p2p: Callable[[], Any]
    _peer_failed: Callable[[int, PeerFailure], None]
    _stop_transport: Callable[..., None]
    _close_connections: Callable[[list[tuple[tuple[int, ...], Any]]], None]
    _all_groups: Callable[[], list[tuple[tuple[int, ...], Any]]]

    @property
    def _elastic(self) -> bool:
        """Launched with ``--nnodes MIN:MAX``: even a world of one may grow."""
        return self._env.min_nodes is not None

    def reform(self, timeout: float) -> tuple[int, ...]:
        """Leave this generation's process group and form the next one over the same store, with the
        processes restarted for lost ranks; the ranks that joined as new processes. Every survivor calls
        this; a restarted process joins from ``__init__``. Subgroups of the old generation are gone."""
        if not self._owns:
            raise ConfigError("this world adopted a process group popmesh did not create, so popmesh cannot "
                              "re-form it: let popmesh.init() create the world")
        if self.size == 1 and not self._elastic:
            return ()
        with self._store_lost_says_so():
            if not self._left:
                self._leave_generation()
            self._join_generation(next_attempt(self._store, self.generation), timeout, fresh=False)
        if self.size > 1:
            self._heartbeat = start_heartbeat(self.p2p(), self._peer_failed)
        return self.newcomers

    def try_reform(self, timeout: float) -> tuple[int, ...] | None:
        """:meth:`reform` without waiting for the restarted process: the first call leaves the generation
        that lost a rank (nothing of it can block this rank any more), unless its survivors formed a group
        (:meth:`survivors`), which lives on until then; each call returns None until a restarted process
        waits to join, then forms the next generation (waiting only for the other survivors, within
        ``timeout``) and returns its newcomers."""
        if self._owns and (self.size > 1 or self._elastic):  # else reform() says what it says (adopted, of one)
            with self._store_lost_says_so():
                if not self._left and not self._hole:
                    self._leave_generation()
                if not self._due():
                    return None
        return self.reform(timeout)

    def newcomer_waiting(self) -> bool:
        """Whether the world should form its next generation now: a process restarted for a lost rank (or, in
        an elastic world, started by a later launcher) waits to join it, or a rank was marked left for good
        since this generation formed (two store reads, three in an elastic world)."""
        if not self._owns or (self.size == 1 and not self._elastic):
            return False
        with self._store_lost_says_so():
            return self._due()

    def settle(self) -> None:
        """The world formed on this generation (its host names exchanged): a process that joined it as new
        joins later generations as a survivor."""
        self._unsettled = False

    def _due(self) -> bool:
        if newcomer_waiting(self._store, self.generation):
            return True
        return self._elastic and left_count(self._store) > self._left_seen

    def survivors(self, gid: int, timeout: float) -> tuple[tuple[int, ...], GroupHandle]:
        """The ranks of this generation still alive, agreed by all of them (:mod:`~popmesh.engines.torch.holes`),
        and a process group of theirs in it, formed by them only: they go on together while the lost
        ranks restart. Waits (within ``timeout``) until the heartbeat names a loss this rank's last
        survivors' group did not know."""
        if not self._owns:
            raise ConfigError("this world adopted a process group popmesh did not create, so popmesh cannot form "
                              "its survivors' group: let popmesh.init() create the world")
        if self._left:
            raise ConfigError("this rank left its generation of the world (world.try_reform()): its survivors' group "
                              "can no longer be formed; call world.try_reform() until it returns")
        if self._heartbeat is None:
            raise ConfigError("world.survivors() needs heartbeats to know which ranks were lost: do not set "
                              "POPMESH_HEARTBEAT_TIMEOUT=0 (and a world of one has nobody to lose)")
        deadline = time.monotonic() + timeout
        heartbeat = self._heartbeat
        while not heartbeat.failed_ranks() - self._hole:
            if time.monotonic() >= deadline:
                raise CommTimeout(f"world.survivors(): no rank of generation {self.generation} was found lost within "
                                  f"{timeout:g} s (call it after a PeerFailure that names a lost rank)", None)
            time.sleep(0.01)
        # What the loss broke goes: the transport (its unreceived frames are kept for the next one), and
        # this rank's connections in every group with a lost rank, so a survivor still blocked there
        # (on a peer that gave up, not on the lost rank) fails now instead of at its timeout.
        older = self._p2p
        self._stop_transport(grace=min(_SURVIVORS_GRACE_S, timeout))
        lost = heartbeat.failed_ranks()
        self._close_connections([h for h in self._all_groups() if lost & set(h[0])])

        def failed() -> frozenset[int]:
            """``lost`` is all the stopped heartbeat found; a rank whose restarted process waits is lost too."""
            return lost | restarted_ranks(self._store, self.generation, self.roster)

        with self._store_lost_says_so():
            members, _ = agree_survivors(self._store, self.generation, self.rank, self.size, failed, deadline)
        left_s = max(deadline - time.monotonic(), 1.0)
        pg = self._dist.new_group(list(members), timeout=timedelta(seconds=left_s), use_local_synchronization=True)
        self._hole = frozenset(range(self.size)) - frozenset(members)
        handle = GroupHandle(GroupSpec(gid, members), pg)
        self._groups.append(handle)
        known = {rank: error for rank, error in heartbeat.errors().items() if rank in self._hole}
        from popmesh.engines.torch.p2p import TorchP2P

        self._p2p = TorchP2P(self, members, pg, known)  # it and the heartbeat keep copies of their own
        if older is not None:
            self._p2p.adopt(older)
        self._heartbeat = start_heartbeat(self._p2p, self._peer_failed, known)
        return members, handle

    def _join_generation(self, attempt: int, timeout: float, *, fresh: bool) -> None:
        """Form the generation of ``attempt`` (or a newer one) with every rank (:func:`join_generation`). A
        process that joined the last one as new and lost it before its world formed (:meth:`settle`) joins
        as new again: it has received nothing yet."""
        fresh = fresh or self._unsettled
        attempt, members = join_generation(self._dist, self._store, self._env, self.backend, attempt, timeout,
                                           fresh=fresh)
        self._unsettled = fresh
        self._left = False
        self._hole = frozenset()
        self.generation = attempt
        self.roster = members
        self.rank, self.size = members.index(self._env.rank), len(members)
        self._left_seen = left_count(self._store) if self._elastic else 0
        self.newcomers = newcomers(self._store, attempt, members)

    @contextmanager
    def _store_lost_says_so(self) -> Iterator[None]:
        """Turn torch's error of a store that is gone into one that says what happened and what to do."""
        try:
            yield
        except PopmeshError:
            raise
        except RuntimeError as e:  # torch's DistNetworkError and friends: is the store still there?
            try:
                self._store.check([ATTEMPT])
            except RuntimeError:
                raise store_lost(self._env, e) from e
            raise

    def _leave_generation(self) -> None:
        """Stop the heartbeat and the transport, close this rank's connections of the old generation (so
        survivors still blocked on it there fail now and re-form too, instead of waiting out their
        timeout), and destroy the process groups, keeping the store."""
        self._stop_transport()
        self._left = True
        self._close_connections(self._all_groups())
        self._groups.clear()
        self._probes.clear()
        self._finished_works.clear()
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
