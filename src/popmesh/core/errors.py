"""The popmesh exception family.

Every error popmesh raises derives from :class:`PopmeshError`. Engine errors are re-raised as one of
these with ``from`` so the original stays visible. Messages say what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "PopmeshError",
    "ConfigError",
    "EngineUnavailable",
    "PeerFailure",
    "PeerClosed",
    "CommTimeout",
    "CollectiveMismatch",
    "MessageError",
    "NotInGroup",
]


class PopmeshError(RuntimeError):
    """Base class of every popmesh error."""


class ConfigError(PopmeshError, ValueError):
    """Bad configuration: environment variables, arguments or a world that cannot be formed."""


class EngineUnavailable(ConfigError, ImportError):
    """An engine was asked for but its package is not installed; the message names the extra."""


class PeerFailure(PopmeshError):
    """A peer rank died or closed its connection while this rank was talking to it.

    ``ranks``: the global ranks at fault, never empty. ``exact`` is False when the engine could not
    tell which peer failed; ``ranks`` then lists every peer of the operation (the suspects).
    """

    def __init__(self, message: str, ranks: Iterable[int], *, exact: bool = True) -> None:
        super().__init__(message)
        self.ranks = tuple(int(r) for r in ranks)
        if not self.ranks:
            raise ValueError("PeerFailure needs the ranks at fault (every peer of the operation if unknown)")
        self.exact = bool(exact)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.ranks), {"exact": self.exact}


class PeerClosed(PeerFailure):
    """A peer closed its transport in order (it finalized its world or exited): it sends nothing more.

    Raised where the engine can tell a goodbye from a broken connection (gloo). Still a failure to
    whoever waits for a message from that peer; a service that only listens may take it as "done".
    """


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
