"""The popmesh exception family.

Every error popmesh raises derives from :class:`PopmeshError`. Engine errors are re-raised as one of
these with ``from`` so the original stays visible. Messages say what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "PopmeshError",
    "ConfigError",
    "EngineUnavailable",
    "PeerFailure",
    "PeerClosed",
    "WorldTooSmall",
    "CommTimeout",
    "CollectiveMismatch",
    "MessageError",
    "NotInGroup",
    "know_hosts",
    "host_of",
]


class PopmeshError(RuntimeError):
    """Base class of every popmesh error."""


class ConfigError(PopmeshError, ValueError):
    """Bad configuration: environment variables, arguments or a world that cannot be formed."""


class EngineUnavailable(ConfigError, ImportError):
    """An engine was asked for but its package is not installed; the message names the extra."""


_RANK_HOSTS: list[str] = []  # host name of each global rank, as the world learned them at init


def know_hosts(hosts: Sequence[str]) -> None:
    """Record the host of every global rank (the World does at init), so failures can name hosts."""
    _RANK_HOSTS[:] = [str(h) for h in hosts]


def host_of(rank: int) -> str:
    """The host global rank ``rank`` runs on, or "" before a world formed."""
    return _RANK_HOSTS[rank] if 0 <= rank < len(_RANK_HOSTS) else ""


class PeerFailure(PopmeshError):
    """A peer rank died or closed its connection while this rank was talking to it.

    ``ranks``: the global ranks at fault, never empty. ``hosts``: the host of each (empty strings
    before a world formed); in a world of several hosts the message names them too. ``exact`` is
    False when the engine could not tell which peer failed; ``ranks`` then lists every peer of the
    operation (the suspects).
    """

    def __init__(self, message: str, ranks: Iterable[int], *, exact: bool = True) -> None:
        self.ranks = tuple(int(r) for r in ranks)
        if not self.ranks:
            raise ValueError("PeerFailure needs the ranks at fault (every peer of the operation if unknown)")
        self.hosts = tuple(host_of(r) for r in self.ranks)
        if len(set(_RANK_HOSTS)) > 1 and all(self.hosts) and " on host " not in message:
            message += " (" + ", ".join(f"rank {r} on host {h}" for r, h in zip(self.ranks, self.hosts)) + ")"
        super().__init__(message)
        self.exact = bool(exact)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.ranks), {"exact": self.exact}


class PeerClosed(PeerFailure):
    """A peer closed its transport in order (it finalized its world or exited): it sends nothing more.

    Raised where the engine can tell a goodbye from a broken connection (gloo). Still a failure to
    whoever waits for a message from that peer; a service that only listens may take it as "done".
    """


class WorldTooSmall(PopmeshError):
    """An elastic world (``popmesh launch --nnodes MIN:MAX``) lost ranks for good and would go on with
    fewer than MIN nodes: the run stops. Not a PeerFailure, so survival loops that re-form after one
    do not try again. ``lost``: the ranks of the last formed world that left for good."""

    def __init__(self, message: str, lost: Iterable[int]) -> None:
        super().__init__(message)
        self.lost = tuple(int(r) for r in lost)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.lost)


class CommTimeout(PopmeshError, TimeoutError):
    """A blocking call did not complete in time. ``missing`` lists ranks that did not arrive, if known."""

    def __init__(self, message: str, missing: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.missing = None if missing is None else tuple(missing)


class CollectiveMismatch(PopmeshError):
    """Ranks called a collective with different ops, shapes or dtypes; raised on every rank."""

    def __init__(self, message: str, per_rank: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.per_rank = dict(per_rank or {})


class MessageError(PopmeshError):
    """A point-to-point frame was truncated, corrupt, foreign, or of a kind the caller did not allow."""


class NotInGroup(PopmeshError):
    """This rank called a group operation on a group it is not a member of."""
