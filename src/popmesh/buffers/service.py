"""What the replay-buffer service's loops share (the manager's and the coordinator's): the messages they
decide to send, waiting for the next request while watching for lost ranks and for a world that re-forms,
and their part of a re-form.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

from popmesh.buffers.protocol import REQUEST_TAG, Message, to_payload
from popmesh.comm import messages
from popmesh.comm.world import Comm
from popmesh.core.errors import CommTimeout, ConfigError, PopmeshError

__all__ = ["LOSS_POLL_S", "Outgoing", "WorldChanging", "moved_keys", "moved_ranks", "next_message", "reform_service",
           "send_outgoing"]

V = TypeVar("V")

LOSS_POLL_S = 1.0  # a waiting service asks the heartbeat about lost ranks this often


class Outgoing(NamedTuple):
    """A message the service decided to send: to global rank ``dst`` on ``tag``."""

    dst: int
    tag: int
    message: Message


def send_outgoing(out: Outgoing, group: Comm | None, timeout: float | None) -> messages.SendHandle:
    """Start sending a service message (non-blocking, so a slow reader never stalls the service)."""
    return messages.isend(to_payload(out.message), out.dst, out.tag, group=group, timeout=timeout)


def reform_service(world: Any, roles: Any, maker: str) -> tuple[set[int], dict[int, int] | None]:
    """A service's part of a re-form: the world's next generation, then the groups of the ``roles`` it
    was made from (None: none), as every other rank makes them. The ranks that joined as new processes,
    and in an elastic world where each old rank went (``roles.renumbered``; None elsewhere, where ranks
    keep their numbers). ``maker``: how the service is made from its roles, for the error of one made
    without them in an elastic world (it could not follow the new numbers)."""
    if roles is None and world.elastic:
        raise ConfigError(f"a service in an elastic world follows its roles across a change of size: make it with "
                          f"{maker}(assign_roles(world, ...))")
    fresh = world.reform()
    if roles is not None:
        roles.rebuild()
    return set(fresh), roles.renumbered if roles is not None and world.elastic else None


def moved_keys(items: Mapping[int, V], moved: Mapping[int, int]) -> dict[int, V]:
    """``items`` keyed by rank, under each rank's new number (``moved``); those of ranks gone dropped."""
    return {moved[r]: value for r, value in items.items() if r in moved}


def moved_ranks(ranks: Iterable[int], moved: Mapping[int, int]) -> set[int]:
    """``ranks`` under their new numbers (``moved``); ranks gone dropped."""
    return {moved[r] for r in ranks if r in moved}


class WorldChanging(PopmeshError):
    """An elastic world is about to re-form (ranks wait to join, or one left for good): a service that
    waits for requests re-forms with it (raised by :func:`next_message`)."""


def next_message(comm: Comm, group: Comm | None, limit: float, tag: int = REQUEST_TAG) -> tuple[int, Any]:
    """The next message on ``tag`` from any rank (a service's requests), waited for in slices of
    :data:`LOSS_POLL_S` between which the heartbeat is asked about lost ranks (PeerFailure), so a
    loss is seen within seconds even where no lost rank was talking to this service; in an elastic
    world a silent slice also asks whether the world should re-form (:class:`WorldChanging`). CommTimeout
    after ``limit`` seconds of silence."""
    deadline = time.monotonic() + limit
    world = comm.world
    while True:
        try:
            return messages.recv(None, tag, group=group, timeout=min(LOSS_POLL_S, limit))
        except CommTimeout:
            lost = world.failure()
            if lost is not None:
                raise lost from None
            # Asked in silence only: a busy service hears of a re-form from its clients, whose connections to
            # it close as they leave the generation (a PeerFailure, after which it re-forms too).
            if world.elastic and world.newcomer_waiting():
                raise WorldChanging("the world re-forms: ranks wait to join it, or one left it for good") from None
            if time.monotonic() >= deadline:
                raise
