"""Point-to-point frames over torch.distributed (gloo) on global ranks.

Every frame travels as an :mod:`~popmesh.engines.envelope` (which names the popmesh tag) on one
internal envelope tag per sender, then its payload segments on the sibling segment tag. Bytes are
raw: nothing is ever value-cast.

Why receive threads: a gloo receive whose ``wait(timeout)`` expires closes the connection
("Application timeout caused pair closure"), and gloo offers no non-blocking completion test. So
*pump* threads keep receives posted from the moment the transport starts (a timeout then never
touches gloo: the caller just stops waiting, and a late message is queued for the next receive),
and every frame is taken as it arrives: a posted receive progresses whatever the caller waits on,
as MPI's progress rule requires (a ring exchange that waits on its send first completes). In worlds
of up to :data:`PEER_PUMPS_MAX` peers each peer has its own pump whose receive names its source,
because gloo pre-announces such a receive to the sender, which then sends at once; an any-source
receive costs two extra network hops per message (about twice the round trip). Wider worlds use one
any-source pump for all peers, so threads per rank stay a small constant. Frames from one sender
stay in order.

Sends are completed by at most :data:`~popmesh.engines.torch.send.SEND_THREADS` worker threads per
rank (:mod:`~popmesh.engines.torch.send`), so a send timeout leaves the message in flight instead
of breaking the connection; frames carried whole in their envelope (up to 512 KiB) are sent eagerly.
A dead peer surfaces as PeerFailure when gloo reports the closed connection, and on a receive
timeout a zero-byte probe tells a dead source (PeerFailure) from a silent one (CommTimeout).

Shutdown: gloo moves a message only while both ends are alive, and a gloo wait that returns to a
Python thread while the interpreter is finalizing aborts the process ("terminate called without
an active exception"). So :meth:`TorchP2P.close` (run by ``World.finalize`` and at exit) first waits
up to :data:`EXIT_GRACE_S` for pending sends, then sends every peer a goodbye envelope and waits up
to :data:`GOODBYE_GRACE_S` for the peers' goodbyes (or closed connections) to end its pumps, so no
wait is left to return during finalization. A peer that receives a goodbye answers with its own, so
a rank that finalizes early does not wait for the others; a receive from a rank that said goodbye
raises PeerClosed (a PeerFailure) once its earlier messages are consumed, and a send to it
PeerFailure. The send workers end with the transport: no popmesh thread outlives ``finalize``. A
program should still let a rank exit only once every message sent *to* it has been received.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError, PeerClosed, PeerFailure, PopmeshError
from popmesh.engines.envelope import goodbye_envelope, plan_frame
from popmesh.engines.p2p_base import BUFFER_NBYTES, BufferPool, Item, P2PBase, RecvRequest, buffer_cap
from popmesh.engines.torch.pumps import (
    CLOSE_TAG,
    CLOSE_WAIT,
    DEPTH,
    ENV_TAG,
    GLOO_ENVELOPE_NBYTES,
    GLOO_INLINE_NBYTES,
    PEER_PUMPS_MAX,
    PING_TAG,
    SEG_TAG,
    AnyPump,
    Pump,
    hands_over,
    peer_pumps_max,
)
from popmesh.engines.torch.send import LONG, Outbox, SendBuffers, SendWorkers, TorchSend, failure, is_gone, tensor

__all__ = ["TorchP2P", "EXIT_GRACE_S", "GOODBYE_GRACE_S", "PEER_PUMPS_MAX", "BUFFER_NBYTES", "buffer_cap"]

EXIT_GRACE_S = 30.0
GOODBYE_GRACE_S = 2.0
_OUTBOXES_KEPT = 64  # send channels kept before idle ones are pruned
_PRUNE_EVERY_S = 1.0  # ... and at most this long after the last pruning
_ROOM_POLL_S = 0.05  # how often a held-back pump looks again (it is also woken when room is made)


def _nbytes(item: Item) -> int:
    data = item[1]
    return int(data.nbytes) if isinstance(data, np.ndarray) else 0


class TorchP2P(P2PBase):
    """Frames between global ranks of the default torch.distributed group (see the module docstring).

    Survivors of a lost rank (``world.survivors()``) run one over their own process group instead:
    ``members`` (global ranks, in the group's rank order) and its ``pg``. Messages still name global
    ranks; a rank outside ``members`` is gone (``lost``: why), so a send to it or a receive that can
    only hear from it raises at once."""

    _tells_arrivals = True  # every delivery runs on a pump thread, which calls _notify

    def __init__(self, engine: Any, members: tuple[int, ...] | None = None, pg: Any = None,
                 lost: Mapping[int, PopmeshError] | None = None) -> None:
        import torch.distributed as dist

        super().__init__(engine.rank, engine.size)
        self._group = dist.group
        self.members = tuple(range(engine.size)) if members is None else members
        self._place = {rank: i for i, rank in enumerate(self.members)}  # global rank -> rank in the pg
        self._own_pg = pg  # None: the default group, looked up on each use (see _pg)
        self._gone.update({rank: why for rank, why in (lost or {}).items() if rank not in self._place})
        self._waiters: list[threading.Lock] = []  # receivers blocked in _block, released on delivery
        self._inbox: dict[int, deque[Item]] = {}  # tag -> frames no receive has taken yet (pruned when empty)
        self._held = 0  # bytes in _inbox
        self._cap = buffer_cap()
        self._room = threading.Condition(self._lock)  # a held-back pump waits here for receives
        self._pumps: dict[int, Pump] = {}  # peer -> the pump that receives from it
        self._outboxes: dict[tuple[int, int], Outbox] = {}  # pruned of idle channels (_prune_outboxes)
        self._outbox_limit = _OUTBOXES_KEPT
        self._next_prune = 0.0  # a new channel after this prunes the idle ones too
        self._workers = SendWorkers()
        self._send_buffers = SendBuffers()  # eager envelopes' buffers, recycled (page faults cost ~20x the copy)
        # One lock per destination keeps a frame's envelope and segments together in that peer's
        # stream; a gloo send of a large segment can block for milliseconds (a full socket), and a
        # single lock made every other destination's sends wait for it.
        self._post_locks: dict[int, threading.Lock] = {}
        self._pool = BufferPool()
        # Posted envelope buffers, reused once a handed-over payload is dropped (a pump holds two).
        self._envelopes = BufferPool(keep=DEPTH * engine.size + 8, min_nbytes=GLOO_ENVELOPE_NBYTES)
        self._pings: list[Any] = []
        self._goodbyes: dict[int, Any] = {}  # peer -> our goodbye send to it
        self._failed_peers: set[int] = set()  # our sends to these were abandoned (_abandon)
        self._closed = False
        atexit.register(self.close)
        self._start_pumps()

    def _start_pumps(self) -> None:
        """Receive from every peer from the start, so a posted receive progresses whatever the caller
        waits on (a peer's send completes once our pump takes it): one pump per peer in worlds of up
        to :data:`PEER_PUMPS_MAX` peers, one any-source pump beyond."""
        peers = [p for p in self.members if p != self.rank]
        if not peers:
            return
        if len(peers) <= peer_pumps_max():
            pumps = [Pump(self, p) for p in peers]
            self._pumps = dict(zip(peers, pumps))
        else:
            pumps = [AnyPump(self)]
            self._pumps = dict.fromkeys(peers, pumps[0])
        for pump in pumps:
            pump.top_up()
            pump.thread.start()

    @property
    def _pg(self) -> Any:
        """The process group: the default one looked up on every use (holding it would keep it, and
        gloo's collective worker threads, alive into interpreter shutdown, where they abort the
        process), or the survivors' own, dropped at :meth:`close`."""
        world = self._group.WORLD
        pg = world if self._own_pg is None or world is None else self._own_pg
        if pg is None:
            raise ConfigError("the torch world was finalized: point-to-point messages need a live world")
        return pg

    def _at(self, rank: int) -> int:
        """``rank``'s place in the process group (its global rank in the default group)."""
        return self._place[rank]

    def adopt(self, older: TorchP2P) -> None:
        """Take in the frames ``older`` (closed, the transport this one replaces) received that no receive
        took yet: nothing sent before the survivors formed their group is lost."""
        with older._lock:
            inbox, older._inbox, held, older._held = older._inbox, {}, older._held, 0
        with self._lock:
            for tag, frames in inbox.items():
                self._inbox.setdefault(tag, deque()).extend(frames)
            self._held += held
        self._notify()

    def flush(self, timeout: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout`` s for every send to complete; returns the (dst, tag) channels still busy."""
        deadline = time.monotonic() + timeout
        with self._lock:
            boxes = dict(self._outboxes)
        for box in boxes.values():
            if box.backlog():
                box.hurry()
        while True:
            busy = [key for key, box in boxes.items() if box.backlog()]
            if not busy or time.monotonic() >= deadline:
                return busy
            time.sleep(0.01)

    def close(self, grace: float = EXIT_GRACE_S) -> None:
        """Flush sends (up to ``grace`` s), say goodbye to every peer and wait for theirs, so no pump
        outlives the world.

        A peer that lives on answers a goodbye with its own, so an early closer does not wait for
        the others to finish. Idempotent; ``World.finalize`` calls it before destroying the process
        group, and it runs at exit. Receives afterwards raise ConfigError.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()  # a held-back pump goes on, to meet the goodbyes
        busy = self.flush(grace)
        if busy:
            sys.stderr.write(f"popmesh: rank {self.rank} closes with sends still pending to (rank, tag) {busy}: "
                             "their receivers never received them\n")
        for peer in self.members:
            self._say_goodbye(peer)
        deadline = time.monotonic() + GOODBYE_GRACE_S
        with self._lock:
            pumps = list({id(p): p for p in self._pumps.values()}.values())
        for pump in pumps:
            if pump.thread.ident is not None:
                pump.thread.join(max(0.0, deadline - time.monotonic()))
        self._workers.close(max(0.0, deadline - time.monotonic()))
        self._own_pg = None

    def _say_goodbye(self, peer: int) -> None:
        """Tell ``peer`` that nothing more comes from us (once); its pump for us then ends."""
        if peer == self.rank or self._group.WORLD is None or peer not in self._place:
            return
        with self._post_lock(peer):
            if peer in self._goodbyes:
                return
            try:
                self._goodbyes[peer] = self._pg.send([tensor(goodbye_envelope())], self._at(peer), ENV_TAG)
            except RuntimeError:
                self._goodbyes[peer] = None  # that peer's connection is closed already

    # ---- sending -----------------------------------------------------------------------------
    def _post_send(self, parts: list[np.ndarray], dst: int, tag: int) -> TorchSend:
        if dst not in self._place:
            why = self._gone.get(dst, "it is not a member of the survivors' group")
            raise PeerFailure(f"send to rank {dst} on tag {tag}: {why}", (dst,))
        if dst in self._goodbyes and dst in self._gone:
            raise PeerFailure(f"send to rank {dst} on tag {tag}: {self._gone[dst]}", (dst,))
        outbox = self._outbox(dst, tag)
        if outbox.error is not None:
            error, outbox.error = outbox.error, None
            raise PeerFailure(f"an earlier send to rank {dst} on tag {tag} failed: {error}", (dst,)) from error
        env, segments = plan_frame(parts, tag, GLOO_INLINE_NBYTES, self._send_buffers.take)
        try:
            pg = self._pg
            at = self._at(dst)
            with self._post_lock(dst):
                works = [pg.send([tensor(env)], at, ENV_TAG)]
                works += [pg.send([tensor(s)], at, SEG_TAG) for s in segments]
        except RuntimeError as e:
            raise failure(e, f"send to rank {dst} on tag {tag}", dst) from e
        base = None if segments else self._send_buffers.base(env)
        op = TorchSend(works, [env, *segments], not segments, outbox,
                       None if base is None else (self._send_buffers, base))
        outbox.push(op)
        return op

    def _post_lock(self, dst: int) -> threading.Lock:
        lock = self._post_locks.get(dst)
        if lock is None:
            with self._lock:
                lock = self._post_locks.setdefault(dst, threading.Lock())
        return lock

    def _outbox(self, dst: int, tag: int) -> Outbox:
        with self._lock:
            if dst in self._failed_peers:  # its sends were abandoned (_abandon): refused, under the lock abandon takes
                raise PeerFailure(f"send to rank {dst} on tag {tag}: {self._gone[dst]}", (dst,))
            box = self._outboxes.get((dst, tag))
            if box is None:
                if len(self._outboxes) >= self._outbox_limit or time.monotonic() >= self._next_prune:
                    self._prune_outboxes()
                box = self._outboxes[(dst, tag)] = Outbox(dst, tag, self._workers)
            return box

    def _prune_outboxes(self) -> None:
        """Forget the channels with nothing in flight and no error to report (a new send makes its
        channel afresh, in order since nothing of the old one is left); amortised O(1) per send."""
        self._outboxes = {key: box for key, box in self._outboxes.items() if box.backlog() or box.error is not None}
        self._outbox_limit = max(_OUTBOXES_KEPT, 2 * len(self._outboxes))
        self._next_prune = time.monotonic() + _PRUNE_EVERY_S
        self._pings = [work for work in self._pings if not work.is_completed()]

    # ---- receiving ---------------------------------------------------------------------------
    def _fetch(self, sources: frozenset[int] | None, tag: int) -> Item | None:
        queue = self._inbox.get(tag)
        for i, item in enumerate(queue or ()):
            if sources is None or item[0] in sources:
                assert queue is not None
                del queue[i]
                if not queue:
                    del self._inbox[tag]
                self._held -= _nbytes(item)
                self._room.notify_all()
                return item
        gone = self._gone_error(sources)
        if gone is not None:  # nothing can arrive any more
            raise gone
        if self._closed:
            raise ConfigError(f"rank {self.rank} closed its point-to-point transport (World.finalize): it receives "
                              "nothing more")
        return None

    def _block(self, req: RecvRequest, timeout: float) -> bool:
        """Wait for ``req`` on a lock of our own that a delivering pump releases (one wake-up, no Condition)."""
        if self._poll(req):
            return True
        deadline = time.monotonic() + timeout
        peers = self._pumps if req.sources is None else req.sources
        for pump in {id(p): p for peer in list(peers) if (p := self._pumps.get(peer)) is not None}.values():
            pump.top_up()
        waiter = threading.Lock()
        waiter.acquire()
        while True:
            with self._lock:
                if self._poll(req):
                    return True
                self._waiters.append(waiter)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not waiter.acquire(timeout=remaining):
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    return self._poll(req)

    def _notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()
        self._tell_listeners()

    def _deliver(self, tag: int, item: Item) -> None:
        with self._lock:
            self._inbox.setdefault(tag, deque()).append(item)
            self._held += _nbytes(item)
        self._notify()

    def _has_room(self) -> bool:
        """Whether the pumps may take another frame: fewer bytes held than the cap."""
        return self._held <= self._cap or self._closed

    def _wait_for_room(self) -> None:
        """Block a pump while this rank holds its cap of bytes for receives not yet made."""
        with self._room:
            while not self._has_room():
                self._room.wait(_ROOM_POLL_S)

    def holding_back(self) -> bool:
        """Whether the pumps take nothing more until the program receives (the cap is reached)."""
        return not self._has_room()

    def memory(self) -> dict[str, int]:
        """:meth:`P2PBase.memory` plus bytes and frames taken but not yet received, the tags they
        sit on, send channels with a table, and bytes queued for sending."""
        with self._lock:
            return {**super().memory(), "held_bytes": self._held, "cap": self._cap,
                    "held_frames": sum(len(q) for q in self._inbox.values()), "inbox_tags": len(self._inbox),
                    "send_channels": len(self._outboxes), "queued_send_bytes": self._workers.eager_nbytes(),
                    "recycled_send_bytes": self._send_buffers.idle_nbytes()}

    def fail_peer(self, rank: int, error: PopmeshError) -> None:
        """Declare ``rank`` failed and close gloo's connection to it, so that anything waiting on it in
        gloo, a collective included, fails at once instead of at its timeout (gloo closes a pair
        whose receive times out: a zero-byte receive with a 1 ms limit does it)."""
        super().fail_peer(rank, error)
        self._abandon(rank, error)
        if self._group.WORLD is None or rank == self.rank or rank not in self._place:
            return
        try:
            self._pg.recv([tensor(np.empty(0, dtype=np.uint8))], self._at(rank), CLOSE_TAG).wait(CLOSE_WAIT)
        except RuntimeError:
            pass  # the expected outcome: "Application timeout caused pair closure"

    def _end_peer(self, peer: int, why: PopmeshError) -> None:
        with self._lock:
            self._gone.setdefault(peer, why)
        if not isinstance(why, PeerClosed):  # a goodbye: its sends to us were flushed, ours may still land
            self._abandon(peer, why)
        self._notify()

    def _abandon(self, peer: int, why: PopmeshError) -> None:
        """``peer`` failed: fail our sends to it now instead of waiting on gloo for them (it may never
        end one, :meth:`SendWorkers.abandon`), and refuse new ones; ``flush`` and ``close`` then have
        nothing of it to wait for."""
        error = why if isinstance(why, PeerFailure) else PeerFailure(f"rank {peer} failed: {why}", (peer,))
        with self._lock:
            self._failed_peers.add(peer)
            boxes = [box for (dst, _), box in self._outboxes.items() if dst == peer]
        self._workers.abandon(boxes, error)

    def _receive_rest(self, envelope: Any, src: int) -> Item:
        if not envelope.lengths:
            if hands_over(envelope):
                return src, envelope.inline  # the pump posts another buffer instead of this one
            return src, envelope.inline.copy()  # the receive buffer is reused for the next envelope
        buf = self._pool.take(envelope.total, envelope.inline.size, envelope.page_offset)
        buf[:envelope.inline.size] = envelope.inline
        pos = envelope.inline.size
        try:
            for n in envelope.lengths:
                self._pg.recv([tensor(buf[pos:pos + n])], self._at(src), SEG_TAG).wait(LONG)
                pos += n
        except (RuntimeError, ConfigError) as e:
            return src, failure(e, f"receiving a frame from rank {src} on tag {envelope.tag}", src)
        return src, buf

    def _timeout_error(self, req: RecvRequest, timeout: float) -> Exception:
        error = super()._timeout_error(req, timeout)
        if req.sources is None or len(req.sources) > 8:
            return error
        dead = tuple(r for r in sorted(req.sources) if r != self.rank and not self._alive(r))
        if dead:
            return PeerFailure(f"rank {self.rank} waited {timeout:g} s for a message on tag {req.tag} from rank(s) "
                               f"{sorted(req.sources)}, and rank(s) {list(dead)} closed their connection (died?)",
                               dead)
        return error

    def _alive(self, rank: int) -> bool:
        """Post a zero-byte send: gloo refuses it at once if the connection to ``rank`` is closed."""
        if rank in self._gone:
            return False
        try:
            self._pings.append(self._pg.send([tensor(np.empty(0, dtype=np.uint8))], self._at(rank), PING_TAG))
        except RuntimeError as e:
            return not is_gone(e)
        return True
