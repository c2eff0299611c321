"""What every engine's point-to-point transport shares: frames, requests, matching, a loopback.

An engine's p2p object moves *frames* (a uint8 array, or a list of buffers sent back to back as one
frame) between **global** ranks on integer tags ``0 <= tag < TAG_LIMIT``. The contract, identical
on every engine:

* Messages from one sender on one tag arrive in the order they were sent; tags are independent
  channels. A receive names a source (an int), a set of sources, or None (any source).
* Receives are matched in the order they were posted (``irecv`` handles and blocking ``recv``), as
  in MPI; a receive for a specific source lets messages from other ranks wait for later receives.
* **Nothing a user sent is lost.** A receive that times out withdraws; the message it was waiting
  for stays queued and the next receive on that channel gets it. An ``irecv`` handle whose
  ``wait`` timed out stays posted (wait again, or drop the handle to withdraw it).
* A send to this process's own rank is delivered locally (a copy), so a world of one can message
  itself.
* Every blocking call takes ``timeout`` seconds and raises CommTimeout (or PeerFailure when the
  engine can tell the peer is gone) instead of hanging.
* **Posted receives progress whatever the caller waits on** (MPI's progress rule): a ring exchange
  ``isend(x, right); h = irecv(left); send.wait(); h.wait()`` completes at every size. Engines that
  move bytes only when polled (MPI) advance every posted receive while any wait of theirs polls
  (:meth:`P2PBase._progress`); the gloo engine's receive threads take every frame as it arrives.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from popmesh.core.errors import CommTimeout, ConfigError, PeerClosed, PopmeshError
from popmesh.core.handles import Completed, Pending
from popmesh.core.launch_env import read_number
from popmesh.engines.base import poll_until
from popmesh.wire.format import join_frame

__all__ = [
    "TAG_LIMIT", "HEARTBEAT_TAG", "Frame", "Item", "RecvRequest", "P2PBase", "LoopbackP2P",
    "BufferPool", "PAGE_NBYTES", "frame_parts", "BUFFER_NBYTES", "buffer_cap",
]

TAG_LIMIT = 1 << 15  # the MPI standard guarantees tags up to 32767 on every implementation
HEARTBEAT_TAG = TAG_LIMIT - 1  # the heartbeats' tag (see liveness), in popmesh's reserved range
PAGE_NBYTES = 4096  # the page whose offsets envelopes carry (see envelope)
Frame = Any  # a uint8 numpy array, a bytes-like object, or a sequence of them (sent as one frame)
Item = tuple[int, Any]  # (source rank, uint8 array or the Exception that replaced the message)
BUFFER_NBYTES = 256 << 20  # bytes of messages a rank holds for receives not yet made (see buffer_cap)


def buffer_cap() -> int:
    """Bytes of messages a rank holds for receives not yet made (``POPMESH_P2P_BUFFER_BYTES``, default
    :data:`BUFFER_NBYTES`). gloo: past it the pumps stop taking frames until the program receives (0
    holds at most the frame each pump has in hand); MPI: what the senders to a rank may have in
    flight to it, shared among them (see :mod:`popmesh.engines.mpi.flow`)."""
    return int(read_number("POPMESH_P2P_BUFFER_BYTES", BUFFER_NBYTES, whole=True,
                           hint="give a whole number of bytes (0 or more)"))


def frame_parts(frame: Frame) -> list[np.ndarray]:
    """Flat uint8 views over the buffers of ``frame`` (copies only non-contiguous buffers)."""
    if type(frame) is bytes:  # a small frame from wire.encode_message
        return [np.frombuffer(frame, np.uint8)]
    buffers = frame if isinstance(frame, (list, tuple)) else [frame]
    parts = []
    for buf in buffers:
        if isinstance(buf, np.ndarray):
            arr = buf if buf.flags.c_contiguous else np.ascontiguousarray(buf)
            parts.append(arr.reshape(-1).view(np.uint8))
            continue
        view = memoryview(buf)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        parts.append(np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8))
    return parts


class BufferPool:
    """Receive buffers for large frames, reused once nothing references them any more.

    A fresh multi-megabyte buffer per message costs page faults comparable to moving the bytes
    (raw engine code reuses one buffer). Buffers handed out stay listed here; :meth:`take` reuses
    one of the exact size whose only references are this pool's, i.e. after every array decoded
    from it was dropped. Smaller frames get plain new buffers.
    """

    MIN_NBYTES = 1 << 20

    def __init__(self, keep: int = 4, min_nbytes: int = MIN_NBYTES) -> None:
        self._keep, self._min = keep, min_nbytes
        self._bufs: list[tuple[np.ndarray, int]] = []  # (buffer, its address): ``.ctypes`` costs ~10 us cold
        self._lock = threading.Lock()

    def take(self, nbytes: int, at: int = 0, page_offset: int = 0) -> np.ndarray:
        """A writable uint8 buffer of ``nbytes`` that nobody else holds, whose byte ``at`` lies
        ``page_offset`` bytes into a memory page (where the sender's segment lay: see
        :mod:`~popmesh.engines.envelope`). The alignment applies to pooled buffers only: below
        :data:`MIN_NBYTES` the copy is short either way."""
        if nbytes < self._min:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            for base, address in self._bufs:
                if base.size == nbytes + PAGE_NBYTES and sys.getrefcount(base) <= 3:  # the pool, ``base``, the argument
                    return _placed(base, address, nbytes, at, page_offset)
            fresh = np.empty(nbytes + PAGE_NBYTES, dtype=np.uint8)
            address = fresh.ctypes.data
            self._bufs = [*self._bufs, (fresh, address)][-self._keep:]
            return _placed(fresh, address, nbytes, at, page_offset)


def _placed(base: np.ndarray, address: int, nbytes: int, at: int, page_offset: int) -> np.ndarray:
    """The ``nbytes`` of ``base`` (one page longer, at ``address``) whose byte ``at`` lies ``page_offset``
    into a page."""
    shift = (page_offset - address - at) % PAGE_NBYTES
    return base[shift:shift + nbytes]


class RecvRequest:
    """A posted receive. ``done()`` polls; ``wait(timeout)`` returns ``(source, uint8 array)``.

    Timing out leaves the request posted; dropping the last reference withdraws it.
    """

    __slots__ = ("__weakref__", "_item", "_owner", "sources", "tag")

    def __init__(self, owner: P2PBase, sources: frozenset[int] | None, tag: int) -> None:
        self.sources, self.tag, self._owner = sources, tag, owner
        self._item: Item | None = None

    def done(self) -> bool:
        return self._owner._poll(self)

    def wait(self, timeout: float) -> tuple[int, np.ndarray]:
        if not self._owner._block(self, timeout):
            raise self._owner._timeout_error(self, timeout)
        return self.result()

    def result(self) -> tuple[int, np.ndarray]:
        """The matched message; re-raises the error that replaced it (e.g. MessageError)."""
        assert self._item is not None, "result() before the receive completed"
        src, data = self._item
        if isinstance(data, BaseException):
            raise data
        return src, data


class P2PBase:
    """Tag and rank checks, posting-order matching and the blocking calls, over three engine hooks.

    Subclasses implement ``_post_send(parts, dst, tag)`` (start a send to another rank),
    ``_fetch(sources, tag)`` (take the next queued message from one of ``sources`` without
    blocking, or None) and ``_block(req, timeout)`` (wait until ``_poll(req)`` is true).
    """

    _tells_arrivals = False  # engines whose every arrival runs _notify set this (see watch)
    # The payload checksum of ``send(checksum=None)``: None covers payloads up to the wire's
    # CHECKSUM_AUTO_LIMIT; False covers small frames only, for engines that guarantee the bytes (MPI).
    payload_checksum: bool | None = None

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._lock = threading.RLock()
        self._posted: dict[int, list[weakref.ref[RecvRequest]]] = {}
        self._local: dict[int, deque[Item]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._gone: dict[int, PopmeshError] = {}  # peers nothing more comes from: why

    # ---- public API --------------------------------------------------------------------------
    def send(self, frame: Frame, dst: int, tag: int, timeout: float) -> None:
        """Send ``frame`` to global rank ``dst``; returns once its buffers may be reused."""
        self.isend(frame, dst, tag).wait(timeout)

    def send_value(self, payload: Any, dst: int, tag: int, timeout: float, checksum: bool | None = None) -> bool:
        """Send a payload the engine frames itself (a short path for small messages); False when it does
        not, and the caller encodes the payload and calls :meth:`send`. The frame is the same bytes."""
        return False

    def isend_value(self, payload: Any, dst: int, tag: int, checksum: bool | None = None) -> Pending | None:
        """Start sending a payload the engine frames itself (see :meth:`send_value`); None when it does
        not, and the caller encodes the payload and calls :meth:`isend`."""
        return None

    def isend(self, frame: Frame, dst: int, tag: int) -> Pending:
        """Start sending; keep ``frame``'s buffers unchanged until the request is done."""
        self._check(dst, tag, "dst")
        parts = frame_parts(frame)
        if dst == self.rank:
            self._deliver_local(tag, join_frame(parts))
            return Completed()
        return self._post_send(parts, dst, tag)

    def recv(self, src: int | Collection[int] | None, tag: int, timeout: float) -> tuple[int, np.ndarray]:
        """The next message on ``tag`` from ``src`` (None: any rank), as ``(source, uint8 array)``."""
        req = self.irecv(src, tag)
        try:
            arrived = self._block(req, timeout)
        finally:
            self._withdraw(req)  # under the lock: from here on no other thread can hand ``req`` a message
        if not arrived and req._item is None:
            raise self._timeout_error(req, timeout)
        return req.result()

    def recv_decoded(self, src: int | Collection[int] | None, tag: int, timeout: float) -> tuple[int, Any, bool]:
        """:meth:`recv`, for engines that may decode a small frame themselves: ``(source, frame, False)``,
        or ``(source, payload, True)`` when the engine decoded it (exactly as ``wire.decode`` would)."""
        sender, frame = self.recv(src, tag, timeout)
        return sender, frame, False

    def irecv(self, src: int | Collection[int] | None, tag: int) -> RecvRequest:
        """Post a receive; it is matched after every receive posted before it on ``tag``."""
        sources = self._sources(src, tag)
        req = RecvRequest(self, sources, tag)
        with self._lock:
            self._posted.setdefault(tag, []).append(weakref.ref(req))
        return req

    def close(self) -> None:
        """Release what the transport holds; override where there is something to release."""
        return None

    def holding_back(self) -> bool:
        """Whether this rank takes no more frames until the program receives some of those it holds
        (the gloo engine's cap, ``POPMESH_P2P_BUFFER_BYTES``); the heartbeat watch pauses meanwhile."""
        return False

    def memory(self) -> dict[str, int]:
        """Sizes of what the transport holds now (tests and docs/messages.md): tags with a posted
        receive, and frames sent to this rank itself not yet received. Engines add their own."""
        with self._lock:
            return {"posted_tags": len(self._posted), "local_frames": sum(len(q) for q in self._local.values())}

    def gone(self, rank: int) -> PopmeshError | None:
        """Why nothing more comes from ``rank`` (it closed in order: PeerClosed; it failed), or None."""
        return self._gone.get(rank)

    def fail_peer(self, rank: int, error: PopmeshError) -> None:
        """Declare ``rank`` failed (the heartbeat found it silent): receives that can only hear from
        failed ranks and sends to it raise ``error`` instead of waiting for their timeout."""
        with self._lock:
            self._gone.setdefault(rank, error)
        self._notify()

    def _gone_error(self, sources: Collection[int] | None) -> PopmeshError | None:
        """The error to raise when every rank of ``sources`` (None: every peer) is gone, else None;
        a broken connection outranks an orderly goodbye."""
        peers = [p for p in (range(self.size) if sources is None else sources) if p != self.rank]
        if not peers or not self._gone:
            return None
        errors = [self._gone[p] for p in peers if p in self._gone]
        if len(errors) < len(peers):
            return None
        return next((e for e in errors if not isinstance(e, PeerClosed)), errors[0])

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``callback`` (on any thread; it must be quick) whenever a message may have arrived.

        Returns a function that stops the calls, or None where this engine learns of messages only
        when someone polls (then poll). Lets a background service sleep until there is work.
        """
        if not self._tells_arrivals:
            return None
        with self._lock:
            self._listeners.append(callback)

        def stop() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return stop

    def _tell_listeners(self) -> None:
        for callback in list(self._listeners):
            callback()

    # ---- matching ----------------------------------------------------------------------------
    def _poll(self, req: RecvRequest) -> bool:
        """Match queued messages to posted receives on ``req.tag`` in posting order; True if ``req`` has one.

        A message fetched for one receive goes to the *earliest* waiting receive that accepts its
        source: it may have arrived after an earlier receive looked and found nothing.
        """
        with self._lock:
            if req._item is not None:
                return True
            posted = self._posted.get(req.tag, [])
            waiting: list[RecvRequest] = []
            for ref in posted:
                handle = ref()
                if handle is None or handle._item is not None:
                    continue
                waiting.append(handle)
                while handle._item is None:
                    item = self._take_local(handle.sources, req.tag) or self._fetch(handle.sources, req.tag)
                    if item is None:
                        break
                    owner = next(w for w in waiting if w._item is None and (w.sources is None or item[0] in w.sources))
                    owner._item = item
            posted[:] = [ref for ref in posted if (h := ref()) is not None and h._item is None]
            if not posted:
                self._posted.pop(req.tag, None)  # per-tag tables hold only tags in use
            return req._item is not None

    def _progress(self) -> None:
        """Advance every posted receive: one matching pass per tag that has a receive waiting."""
        if not self._posted:
            return
        with self._lock:
            for posted in list(self._posted.values()):
                handle = next((h for ref in posted if (h := ref()) is not None and h._item is None), None)
                if handle is not None:
                    self._poll(handle)

    def _progressing(self, done: Callable[[], bool], every: int = 8) -> Callable[[], bool]:
        """``done``, advancing every posted receive (and whatever else the engine progresses: see
        :meth:`_progress`) on each ``every``-th call (for polling waits)."""
        calls = 0

        def check() -> bool:
            nonlocal calls
            calls += 1
            if calls % every == 0:
                self._progress()
            return done()

        return check

    def _withdraw(self, req: RecvRequest) -> None:
        with self._lock:
            posted = self._posted.get(req.tag, [])
            for ref in posted:
                if ref() is req:
                    posted.remove(ref)
                    break
            if not posted:
                self._posted.pop(req.tag, None)

    def _deliver_local(self, tag: int, data: np.ndarray) -> None:
        with self._lock:
            self._local.setdefault(tag, deque()).append((self.rank, data))
        self._notify()

    def _take_local(self, sources: frozenset[int] | None, tag: int) -> Item | None:
        queue = self._local.get(tag)
        if queue and (sources is None or self.rank in sources):
            item = queue.popleft()
            if not queue:
                del self._local[tag]
            return item
        return None

    # ---- checks and errors -------------------------------------------------------------------
    def _check(self, rank: int, tag: int, what: str) -> None:
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag={tag!r}: p2p tags are integers in [0, {TAG_LIMIT})")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ConfigError(f"{what}={rank!r} is not a rank of this world of {self.size}: pass a global rank "
                              f"in [0, {self.size})")

    def _sources(self, src: int | Collection[int] | None, tag: int) -> frozenset[int] | None:
        if src is None:
            self._check(self.rank, tag, "src")
            return None
        ranks = [src] if isinstance(src, int) else list(src)
        for r in ranks:
            self._check(r, tag, "src")
        if not ranks:
            raise ConfigError("src is an empty collection of ranks: pass None for any source")
        return frozenset(ranks)

    def _timeout_error(self, req: RecvRequest, timeout: float) -> Exception:
        who = "any rank" if req.sources is None else f"rank(s) {sorted(req.sources)}"
        missing = None if req.sources is None else tuple(sorted(req.sources))
        return CommTimeout(
            f"rank {self.rank} received no message from {who} on tag {req.tag} within {timeout:g} s. The message "
            "is not lost if it comes later: the next receive on this channel gets it. Check that the sender sends "
            "on this tag to this rank, or raise the timeout (timeout=..., POPMESH_TIMEOUT).", missing)

    # ---- engine hooks ------------------------------------------------------------------------
    def _post_send(self, parts: list[np.ndarray], dst: int, tag: int) -> Pending:
        raise ConfigError(f"rank {self.rank} cannot send to rank {dst}: this engine only delivers to itself")

    def _fetch(self, sources: frozenset[int] | None, tag: int) -> Item | None:
        return None

    def _block(self, req: RecvRequest, timeout: float) -> bool:
        return poll_until(self._progressing(lambda: self._poll(req)), timeout)

    def _notify(self) -> None:
        return None


class LoopbackP2P(P2PBase):
    """The p2p of a world of one: a rank may send to itself (delivered as a copy), nothing else."""

    _tells_arrivals = True

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._cond = threading.Condition(self._lock)

    def _block(self, req: RecvRequest, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._poll(req), timeout)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._tell_listeners()
