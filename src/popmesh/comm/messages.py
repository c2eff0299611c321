"""Point-to-point messages: one framed wire format on every engine, tags, timeouts, async handles.

``send(payload, dst, tag)`` / ``recv(src, tag) -> (src, payload)`` move bytes, numpy arrays, torch
tensors (dtype and shape kept, bfloat16 included; ``device=`` on receive), JSON values and dicts of
arrays (replay batches) between **global** ranks. Every payload is one :mod:`popmesh.wire.encoding` frame, so
a message is the same bytes on torch and on MPI. Pickled objects travel only with
``allow_pickle=True`` on both ends.

Contract (see ``docs/messages.md``):

* Messages from one sender on one tag arrive in order; tags are independent channels. ``src=None``
  receives from any rank (of ``group``, when one is given) and returns the sender.
* **Nothing a user sent is lost**: a receive that times out raises CommTimeout and the message it
  was waiting for goes to the next receive on that channel. An ``irecv`` handle whose ``wait`` timed
  out stays posted; wait again or drop it.
* A truncated, corrupt or foreign frame raises :class:`FrameError` (a MessageError) on the receiver,
  which consumed the bad message and keeps working.
* Tags: user tags are ``0 <= tag < INTERNAL_TAG_BASE``; the top of the tag space is reserved for
  popmesh's own services (:func:`internal_tag`) and rejected with ConfigError when passed as a
  plain int.
* Every blocking call has a timeout (the world's default when None).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from typing import Any

from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, MessageError, PopmeshError
from popmesh.core.handles import Handle
from popmesh.core.timeouts import resolve_timeout
from popmesh.engines.p2p_base import TAG_LIMIT
from popmesh.wire import decode, encode_message

__all__ = [
    "INTERNAL_TAG_BASE", "TAG_LIMIT", "BUFFERS_TAGS", "POPULATION_TAGS", "GUARD_TAGS", "OBSERVE_TAGS", "HANDOVER_TAGS",
    "InternalTag", "internal_tag",
    "FrameError", "SendHandle", "RecvHandle", "send", "recv", "isend", "irecv", "take_arrived", "on_arrival",
]

INTERNAL_TAG_BASE = TAG_LIMIT - 1024
BUFFERS_TAGS = range(INTERNAL_TAG_BASE, INTERNAL_TAG_BASE + 64)
POPULATION_TAGS = range(INTERNAL_TAG_BASE + 64, INTERNAL_TAG_BASE + 128)
GUARD_TAGS = range(INTERNAL_TAG_BASE + 128, INTERNAL_TAG_BASE + 192)
OBSERVE_TAGS = range(INTERNAL_TAG_BASE + 192, INTERNAL_TAG_BASE + 256)
HANDOVER_TAGS = range(INTERNAL_TAG_BASE + 256, INTERNAL_TAG_BASE + 320)


class InternalTag(int):
    """A tag in popmesh's reserved range; made only by :func:`internal_tag` for popmesh's services."""


def internal_tag(offset: int) -> InternalTag:
    """The reserved tag ``INTERNAL_TAG_BASE + offset`` (0 <= offset < 1024), accepted by send/recv.

    Offsets 0-63 belong to the replay-buffer service (:data:`BUFFERS_TAGS`), 64-127 to population
    policies (:data:`POPULATION_TAGS`), 128-191 to the collectives' mismatch guard (:data:`GUARD_TAGS`),
    192-255 to ``popmesh.observe`` (:data:`OBSERVE_TAGS`), 256-319 to the streamed hand-over of
    :mod:`popmesh.torch.stream` (:data:`HANDOVER_TAGS`); the rest is free for future services.
    """
    if not 0 <= offset < TAG_LIMIT - INTERNAL_TAG_BASE:
        raise ConfigError(f"internal tag offset {offset} is outside [0, {TAG_LIMIT - INTERNAL_TAG_BASE})")
    return InternalTag(INTERNAL_TAG_BASE + offset)


class FrameError(MessageError):
    """A received message could not be decoded; ``src`` and ``tag`` say where it came from."""

    def __init__(self, message: str, src: int, tag: int) -> None:
        super().__init__(message)
        self.src, self.tag = src, tag


def _tag(tag: Any) -> int:
    if type(tag) is int and 0 <= tag < INTERNAL_TAG_BASE:  # the common case, checked first
        return tag
    if isinstance(tag, InternalTag):
        return int(tag)
    try:
        value = operator.index(tag)
    except TypeError:
        raise ConfigError(f"tag={tag!r} must be an integer in [0, {INTERNAL_TAG_BASE})") from None
    if isinstance(tag, bool) or not 0 <= value < INTERNAL_TAG_BASE:
        reserved = INTERNAL_TAG_BASE <= value < TAG_LIMIT
        raise ConfigError(f"tag={tag!r} " + (
            f"is reserved for popmesh's own services ([{INTERNAL_TAG_BASE}, {TAG_LIMIT})): pick a tag below "
            f"{INTERNAL_TAG_BASE}" if reserved else f"must be an integer in [0, {INTERNAL_TAG_BASE})"))
    return value


def _setup(group: Comm | None, timeout: float | None, what: str) -> tuple[Comm, Any, float]:
    comm = resolve_group(group)
    comm.require_member(what)
    world = comm.world
    seconds = world.default_timeout if timeout is None else resolve_timeout(timeout, world.default_timeout,
                                                                              "timeout", what)
    p2p = getattr(world.engine, "p2p", None)
    if p2p is None:
        raise ConfigError(f"the {world.engine.name} engine has no point-to-point messages: use the torch or mpi "
                          "engine")
    return comm, p2p(), seconds


def _member(comm: Comm, rank: Any, what: str) -> int:
    if type(rank) is int and comm.spec.gid == 0 and 0 <= rank < len(comm.spec.ranks):  # the world: the common case
        return rank
    try:
        value = operator.index(rank)
    except TypeError:
        raise ConfigError(f"{what}={rank!r} must be an integer global rank") from None
    if value not in comm.ranks:
        raise ConfigError(f"{what}={rank} is not a rank of {comm!r}: pass the global rank of a member")
    return value


def _sources(comm: Comm, src: int | Collection[int] | None) -> int | frozenset[int] | None:
    if type(src) is int:  # the common case first: an ABC isinstance costs ~0.5 us
        return _member(comm, src, "src")
    if src is None:
        return None if comm.size == comm.world.size else frozenset(comm.ranks)
    if isinstance(src, Collection):
        return frozenset(_member(comm, r, "src") for r in src)
    return _member(comm, src, "src")


def _decode(src: int, tag: int, frame: Any, allow_pickle: bool, device: Any) -> Any:
    try:
        return decode(frame, allow_pickle=allow_pickle, device=device)
    except MessageError as e:
        raise FrameError(f"message from rank {src} on tag {tag}: {e}", src, tag) from e


def send(payload: Any, dst: int, tag: int = 0, *, group: Comm | None = None, timeout: float | None = None,
         allow_pickle: bool = False, checksum: bool | None = None) -> None:
    """Send ``payload`` to global rank ``dst``; returns once ``payload`` may be changed again.

    ``dst`` must be a member of ``group`` (default: the world). Raises MessageError if the payload
    needs pickle and ``allow_pickle`` is False, CommTimeout/PeerFailure if it cannot be delivered.
    ``checksum``: the payload checksum (XXH3-64, :mod:`popmesh.wire.format`; ~9 us per 336 KB on each
    side): True covers every payload, False none beyond small frames (the header is always covered),
    None the engine's default: on gloo payloads up to 1 MiB, on MPI small frames only (MPI guarantees
    the bytes it delivers; see docs/messages.md).
    """
    comm, p2p, seconds = _setup(group, timeout, "send")
    rank, value = _member(comm, dst, "dst"), _tag(tag)
    if p2p.send_value(payload, rank, value, seconds, checksum):  # a payload the engine frames itself
        return
    frame = encode_message(payload, allow_pickle=allow_pickle,
                           checksum=p2p.payload_checksum if checksum is None else checksum)
    p2p.send(frame, rank, value, seconds)


def recv(src: int | Collection[int] | None = None, tag: int = 0, *, group: Comm | None = None,
         timeout: float | None = None, allow_pickle: bool = False, device: Any = None) -> tuple[int, Any]:
    """The next message on ``tag`` from global rank ``src`` (None: any member of ``group``): ``(src, payload)``.

    Tensors come back on ``device`` (None: CPU; ``"same"``: the sender's device type). CommTimeout
    after ``timeout`` seconds, the message staying queued for the next receive; FrameError if it
    cannot be decoded.
    """
    comm, p2p, seconds = _setup(group, timeout, "recv")
    value = _tag(tag)
    sender, frame, decoded = p2p.recv_decoded(_sources(comm, src), value, seconds)
    return sender, frame if decoded else _decode(sender, value, frame, allow_pickle, device)


class SendHandle(Handle[None]):
    """A send in flight: ``done()`` polls; ``wait(timeout)`` blocks until ``payload`` may be changed."""


class RecvHandle(Handle[tuple[int, Any]]):
    """A posted receive: ``done()`` polls; ``wait(timeout)`` returns ``(src, payload)``.

    Receives are matched in the order they were posted. After a timed-out ``wait`` the receive stays
    posted; dropping the handle withdraws it.
    """


def isend(payload: Any, dst: int, tag: int = 0, *, group: Comm | None = None, timeout: float | None = None,
          allow_pickle: bool = False, checksum: bool | None = None) -> SendHandle:
    """Start sending ``payload`` (options as :func:`send`); leave its arrays unchanged until the handle is done."""
    comm, p2p, seconds = _setup(group, timeout, "isend")
    rank, value = _member(comm, dst, "dst"), _tag(tag)
    pending = p2p.isend_value(payload, rank, value, checksum)  # a payload the engine frames itself
    if pending is None:
        frame = encode_message(payload, allow_pickle=allow_pickle,
                               checksum=p2p.payload_checksum if checksum is None else checksum)
        pending = p2p.isend(frame, rank, value)
    return SendHandle(pending, seconds)


def irecv(src: int | Collection[int] | None = None, tag: int = 0, *, group: Comm | None = None,
          timeout: float | None = None, allow_pickle: bool = False, device: Any = None) -> RecvHandle:
    """Post a receive; ``wait()`` returns ``(src, payload)`` like :func:`recv`."""
    comm, p2p, seconds = _setup(group, timeout, "irecv")
    value = _tag(tag)

    def decode(arrived: tuple[int, Any]) -> tuple[int, Any]:
        sender, frame = arrived
        return sender, _decode(sender, value, frame, allow_pickle, device)

    return RecvHandle(p2p.irecv(_sources(comm, src), value), seconds, decode)



def take_arrived(standing: RecvHandle | None, tag: int,
                 closed_by: type[Exception] = PopmeshError) -> tuple[RecvHandle | None, list[tuple[int, Any]]]:
    """Every message a standing any-source receive on ``tag`` has got, without blocking, and the
    receive to keep standing: posted again after each message, None once waiting raised
    ``closed_by`` (no sender left) or when ``standing`` was None already."""
    arrived: list[tuple[int, Any]] = []
    while standing is not None:
        try:
            if not standing.done():
                break
            arrived.append(standing.wait())
        except closed_by:
            return None, arrived
        standing = irecv(None, tag)
    return standing, arrived

def on_arrival(callback: Callable[[], None], *, group: Comm | None = None) -> Callable[[], None] | None:
    """Call ``callback`` whenever a message may have arrived for this rank (any tag, any source).

    For background services that would otherwise poll: they can sleep until called. The callback
    runs on popmesh's receive thread and must only signal (e.g. ``threading.Event.set``). Returns a
    function that stops the calls, or None on engines that learn of messages only when polled
    (MPI): keep polling there.
    """
    comm = resolve_group(group)
    p2p = getattr(comm.world.engine, "p2p", None)
    return None if p2p is None else p2p().watch(callback)
