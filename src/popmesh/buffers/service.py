"""What the replay-buffer service's loops share (the manager's and the coordinator's): the messages they
decide to send, waiting for the next request while watching for lost ranks and for a world that re-forms,
and their part of a re-form.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from popmesh.buffers.protocol import REQUEST_TAG, Message, to_payload
from popmesh.comm import messages
from popmesh.comm.world import Comm
from popmesh.core.errors import CommTimeout, PopmeshError

__all__ = ["LOSS_POLL_S", "Outgoing", "WorldChanging", "next_message", "reform_service", "send_outgoing"]

LOSS_POLL_S = 1.0  # a waiting service asks the heartbeat about lost ranks this often


class Outgoing(NamedTuple):
    """A message the service decided to send: to global rank ``dst`` on ``tag``."""

    dst: int
    tag: int
    message: Message


def send_outgoing(out: Outgoing, group: Comm | None, timeout: float | None) -> messages.SendHandle:
    """Start sending a service message (non-blocking, so a slow reader never stalls the service)."""
    return messages.isend(to_payload(out.message), out.dst, out.tag, group=group, timeout=timeout)


def reform_service(world: Any, roles: Any) -> set[int]:
    """A service's part of a re-form: the world's next generation, then the groups of the ``roles`` it
    was made from (None: none), as every other rank makes them; the ranks that joined as new processes."""
    fresh = world.reform()
    if roles is not None:
        roles.rebuild()
    return set(fresh)


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
