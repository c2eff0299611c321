"""A world of one: every collective is the identity. Starts nothing and needs no package."""

from __future__ import annotations

import socket
from collections.abc import Collection
from typing import Any

from popmesh.core.errors import ConfigError, PeerFailure
from popmesh.core.handles import Completed
from popmesh.core.ops import ReduceOp
from popmesh.engines.base import GroupSpec, SnapshotWindow, Tuning

__all__ = ["LocalEngine"]


class LocalEngine:
    """The engine of a single process; collectives return (copies of) their inputs."""

    name = "local"
    rank = 0
    size = 1
    one_sided = False
    generation = 0  # worlds of this engine never re-form
    newcomers: tuple[int, ...] = ()
    roster: tuple[int, ...] = (0,)  # a world of one never changes size
    tuning = Tuning()
    _p2p: Any = None

    def hostname(self) -> str:
        return socket.gethostname()

    def local_topology(self) -> tuple[int, int]:
        return 0, 1

    def p2p(self) -> Any:
        """A world of one may message itself: sends to rank 0 are delivered locally (a copy)."""
        if self._p2p is None:
            from popmesh.engines.p2p_base import LoopbackP2P

            self._p2p = LoopbackP2P()
        return self._p2p

    def make_group(self, spec: GroupSpec, timeout: float) -> Any:
        return spec

    def all_reduce_(self, buf: Any, op: ReduceOp, group: Any, timeout: float) -> None:
        return None

    def all_reduce_start(self, buf: Any, op: ReduceOp, group: Any) -> Completed:
        return Completed()

    def all_gather(self, buf: Any, group: Any, timeout: float) -> Any:
        return buf.reshape((1,) + tuple(buf.shape)).clone() if hasattr(buf, "clone") else buf[None].copy()

    def broadcast_(self, buf: Any, root: int, group: Any, timeout: float) -> None:
        return None

    def gather(self, buf: Any, root: int, group: Any, timeout: float) -> Any:
        return self.all_gather(buf, group, timeout)

    def reduce_scatter(self, buf: Any, op: ReduceOp, group: Any, timeout: float) -> Any:
        return buf.clone() if hasattr(buf, "clone") else buf.copy()

    def barrier(self, group: Any, timeout: float) -> None:
        return None

    def native_group(self, group: Any) -> Any:
        return None  # a world of one has no engine communicator: the popmesh group is the only one

    def snapshot_window(self, group: Any, nbytes: int) -> SnapshotWindow:
        """No one-sided windows on this engine (``one_sided`` is False)."""
        raise ConfigError(f"the {self.name} engine has no one-sided windows: launch under mpiexec or "
                          "popmesh.init(engine='mpi')")

    def peer_failure(self, ranks: Collection[int] | None = None) -> PeerFailure | None:
        return None  # a world of one has no peer to lose

    def reform(self, timeout: float) -> tuple[int, ...]:
        """A world of one has no other rank to lose: nothing to re-form."""
        return ()

    def try_reform(self, timeout: float) -> tuple[int, ...] | None:
        return ()

    def newcomer_waiting(self) -> bool:
        return False

    def settle(self) -> None:
        return None  # a world that never re-forms has no newcomers

    def survivors(self, gid: int, timeout: float) -> tuple[tuple[int, ...], Any]:
        raise ConfigError("a world of one has no rank to lose: there is no survivors' group to form")

    def finalize(self) -> None:
        return None
