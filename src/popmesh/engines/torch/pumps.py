"""The receive side of the gloo point-to-point transport: pump threads that keep envelope receives
posted and take every frame as it arrives (see :mod:`popmesh.engines.torch.p2p` for why), and the
internal tags and buffer sizes that both sides of the transport share.

A :class:`Pump` serves one peer (its receives name their source, which gloo pre-announces to the
sender); an :class:`AnyPump` serves every peer of a wide world on any-source receives, so threads
per rank stay a small constant.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta
from typing import Any, Protocol

import numpy as np

from popmesh.core.errors import ConfigError, MessageError, PeerClosed, PeerFailure, PopmeshError
from popmesh.core.launch_env import read_number
from popmesh.engines.envelope import GOODBYE_TAG, HEADER_NBYTES, MAX_SEGMENTS, parse_envelope
from popmesh.engines.p2p_base import BufferPool, Item
from popmesh.engines.torch.send import LONG, failure, tensor

__all__ = ["Pump", "AnyPump", "PumpOwner", "peer_pumps_max", "hands_over", "ENV_TAG", "SEG_TAG", "PING_TAG",
           "CLOSE_TAG", "CLOSE_WAIT", "DEPTH", "PEER_PUMPS_MAX", "GLOO_ENVELOPE_NBYTES", "GLOO_INLINE_NBYTES",
           "HANDOVER_NBYTES"]

TAG_BASE = 1 << 20  # kept away from the small tags a program may use with dist.send itself
ENV_TAG, SEG_TAG, PING_TAG = TAG_BASE, TAG_BASE + 1, TAG_BASE - 1
CLOSE_TAG = TAG_BASE - 3  # nobody sends on it: a receive that times out there closes the connection
CLOSE_WAIT = timedelta(milliseconds=1)
DEPTH = 2  # envelope receives posted ahead per pump
PEER_PUMPS_MAX = 8  # worlds with more peers receive on one any-source pump (see AnyPump)
# Frames up to ~512 KiB travel inline: one gloo message, sent at once into a receive posted ahead,
# instead of an envelope and a segment that waits until the receiver has read the envelope and
# posted its receive (a round of socket hops and thread wake-ups more). Inline payloads of
# HANDOVER_NBYTES or more are handed to the receiver in the posted buffer itself (no copy) and a
# pooled buffer is posted in its place. Larger frames keep segments: inlining 900 KB measured
# 15-20 % slower (the sender's copy outweighs the saved hop). The posted buffers are virtual
# memory until a frame that large arrives from that peer.
GLOO_ENVELOPE_NBYTES = 1 << 19
GLOO_INLINE_NBYTES = GLOO_ENVELOPE_NBYTES - HEADER_NBYTES - 8 * MAX_SEGMENTS
HANDOVER_NBYTES = 1 << 16


class PumpOwner(Protocol):
    """What a pump needs of its transport (:class:`~popmesh.engines.torch.p2p.TorchP2P`)."""

    members: tuple[int, ...]
    rank: int
    _envelopes: BufferPool

    @property
    def _pg(self) -> Any: ...
    def _at(self, rank: int) -> int: ...
    def _has_room(self) -> bool: ...
    def _wait_for_room(self) -> None: ...
    def _end_peer(self, peer: int, why: PopmeshError) -> None: ...
    def _say_goodbye(self, peer: int) -> None: ...
    def _receive_rest(self, envelope: Any, src: int) -> Item: ...
    def _deliver(self, tag: int, item: Item) -> None: ...
    def _alive(self, rank: int) -> bool: ...


class Pump:
    """The receive side of one peer: envelope receives posted ahead, and the thread that waits on them.

    Gloo announces a posted receive to the sender, which then sends at once; so :data:`DEPTH`
    receives stay posted. Posting writes to the socket, so the thread that takes a message does not
    repost at once (that write would delay the caller's reply): a receiving caller calls
    :meth:`top_up` before it blocks, and the pump posts only when nothing is posted any more.
    """

    def __init__(self, owner: PumpOwner, peer: int | None) -> None:
        self.owner, self.peer = owner, peer
        self._lock = threading.Lock()
        self._posted: deque[tuple[Any, np.ndarray]] = deque()
        self._spare = [owner._envelopes.take(GLOO_ENVELOPE_NBYTES) for _ in range(DEPTH)]
        self.ended = False
        name = "popmesh-p2p-recv-any" if peer is None else f"popmesh-p2p-recv-{peer}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def top_up(self) -> None:
        """Post the spare envelope receives (a receiving caller runs this before it blocks).

        A failure to post (the peer's connection closed) is left to the pump thread, which meets the
        same error on its own receive and records why the peer is gone.
        """
        if self._spare and not self.ended and self.owner._has_room():
            with self._lock:
                try:
                    while self._spare and not self.ended:
                        self._post()
                except (RuntimeError, ConfigError):
                    pass

    def _post(self) -> None:
        buf = self._spare[-1]
        assert self.peer is not None
        work = self.owner._pg.recv([tensor(buf)], self.owner._at(self.peer), ENV_TAG)
        self._posted.append((work, self._spare.pop()))

    def _next(self) -> tuple[Any, np.ndarray]:
        """The next posted receive; posts one when none is, once the owner holds fewer than its cap
        of bytes for receives not yet made (back-pressure: gloo moves a frame only into a posted
        receive, so the sender's send waits meanwhile)."""
        with self._lock:
            if self._posted:
                return self._posted.popleft()
        self.owner._wait_for_room()
        with self._lock:
            if not self._posted:
                self._post()
            return self._posted.popleft()

    def _source(self, work: Any) -> int:
        assert self.peer is not None
        return self.peer

    def _failed(self, e: Exception) -> bool:
        """The posted receive failed: record why; True if this pump ends."""
        assert self.peer is not None
        self._end(failure(e, f"receiving from rank {self.peer}", self.peer))
        return True

    def _accepts(self, peer: int) -> bool:
        return True

    def _stop_following(self, peer: int) -> bool:
        """``peer``'s stream broke: take nothing more from it; True if this pump ends."""
        return True

    def _said_goodbye(self, peer: int) -> bool:
        """``peer`` closed its transport: record it; True if this pump ends."""
        self._end(PeerClosed(f"rank {peer} closed its point-to-point transport (it finalized its world or exited): "
                             "it sends nothing more", (peer,)))
        return True

    def _run(self) -> None:
        owner = self.owner
        try:
            work, buf = self._next()
        except (RuntimeError, ConfigError) as e:
            self._failed(e)
            return
        while True:
            try:
                work.wait(LONG)
                peer = self._source(work)
            except (RuntimeError, ConfigError) as e:
                if self._failed(e):
                    return
                with self._lock:
                    self._spare.append(buf)
                work, buf = self._next()
                continue
            try:
                envelope = parse_envelope(buf, exact=False, inline_nbytes=GLOO_INLINE_NBYTES)
            except MessageError as e:  # the stream from ``peer`` cannot be followed any more
                owner._end_peer(peer, MessageError(f"from rank {peer}: {e}; no more messages are taken from it"))
                if self._stop_following(peer):
                    return self._end(None)
                envelope = None
            if envelope is not None and not self._accepts(peer):
                envelope = None  # a peer whose stream could not be followed: its frames are dropped
            if envelope is not None and envelope.tag == GOODBYE_TAG:
                owner._say_goodbye(peer)  # so that peer's pump for us ends too, even while we live on
                if self._said_goodbye(peer):
                    return
                envelope = None
            item = owner._receive_rest(envelope, peer) if envelope is not None else None
            if envelope is not None and hands_over(envelope):  # the payload keeps ``buf``: post another
                buf = owner._envelopes.take(GLOO_ENVELOPE_NBYTES)
            with self._lock:
                self._spare.append(buf)
            if item is not None and not owner._has_room():  # hand it over before holding back
                owner._deliver(envelope.tag, item)  # type: ignore[union-attr]
                item = None
            try:
                work, buf = self._next()
            except (RuntimeError, ConfigError) as e:
                if item is not None:
                    owner._deliver(envelope.tag, item)  # type: ignore[union-attr]
                self._failed(e)
                return
            if item is not None:  # last before waiting again: the woken caller finds the GIL free
                owner._deliver(envelope.tag, item)  # type: ignore[union-attr]

    def _end(self, why: PopmeshError | None) -> None:
        """No thread waits on this pump's receives any more (those still posted are left to gloo)."""
        self.ended = True
        if why is not None and self.peer is not None:
            self.owner._end_peer(self.peer, why)


class AnyPump(Pump):
    """The receive side of a wide world: one thread for every peer, on any-source envelope receives.

    A thread per peer would make threads per rank grow with the world. An any-source receive costs
    gloo two more socket hops per message (the sender announces, the receiver answers), so worlds
    of up to :data:`PEER_PUMPS_MAX` peers keep one pump per peer. Frames from one sender stay in
    order: gloo matches posted any-source receives in posting order. The pump ends once every peer
    said goodbye or is gone.
    """

    def __init__(self, owner: PumpOwner) -> None:
        super().__init__(owner, None)
        self._open = set(owner.members) - {owner.rank}

    def _post(self) -> None:
        buf = self._spare[-1]
        work = self.owner._pg.recv_anysource([tensor(buf)], ENV_TAG)
        self._posted.append((work, self._spare.pop()))

    def _source(self, work: Any) -> int:
        return self.owner.members[int(work.source_rank())]

    def _accepts(self, peer: int) -> bool:
        return peer in self._open

    def _stop_following(self, peer: int) -> bool:
        self._open.discard(peer)
        return not self._open

    def _failed(self, e: Exception) -> bool:
        """An any-source receive failed without naming its peer: find the peers whose connection is closed."""
        dead = [p for p in sorted(self._open) if not self.owner._alive(p)]
        for peer in dead:
            self._open.discard(peer)
            self.owner._end_peer(peer, failure(e, f"receiving from rank {peer}", peer))
        if dead and self._open:
            return False
        for peer in sorted(self._open):
            self.owner._end_peer(peer, PeerFailure(f"receiving from any rank failed in torch.distributed: {e}",
                                                   (peer,), exact=False))
        self._end(None)
        return True

    def _said_goodbye(self, peer: int) -> bool:
        self._open.discard(peer)
        self.owner._end_peer(peer, PeerClosed(f"rank {peer} closed its point-to-point transport (it finalized "
                                              "its world or exited): it sends nothing more", (peer,)))
        if self._open:
            return False
        self._end(None)
        return True


def peer_pumps_max() -> int:
    """Most peers that get a pump each: :data:`PEER_PUMPS_MAX`, or ``POPMESH_GLOO_PEER_PUMPS`` (0: always
    one any-source pump, the fewest threads)."""
    return int(read_number("POPMESH_GLOO_PEER_PUMPS", PEER_PUMPS_MAX, whole=True,
                           hint="give a whole number of peers (0 or more)"))


def hands_over(envelope: Any) -> bool:
    """Whether a received frame is given to the receiver in its posted buffer (large, all inline)."""
    return not envelope.lengths and envelope.inline.size >= HANDOVER_NBYTES
