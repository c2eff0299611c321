"""Point-to-point frames over MPI on global ranks, on a communicator of their own.

The engine duplicates COMM_WORLD once at start-up for point-to-point messages only, so neither user
collectives nor popmesh's internal diagnostics can ever match a message. Frames use the same
:mod:`~popmesh.engines.envelope` as the gloo engine: the envelope on MPI tag ``2 * tag`` (found
with a matched probe, ``Improbe``, polled until the timeout, and sized from the status with
``Get_count(MPI.BYTE)``), then each payload segment as one contiguous message on ``2 * tag + 1``,
sent straight from the caller's buffers (MPICH packs derived datatypes, which ran at a third of
the speed). Segment receives are posted non-blocking as soon as the envelope arrives and completed
by polling, so every wait keeps its timeout; a frame still arriving holds back only later frames
from the same sender on the same tag.

When a receive is the only one posted on its tag (for one source or any) and no frame is half
received or queued locally, each poll is one matched probe with no matching pass (:meth:`MpiP2P._poll`).

A receive that times out has taken nothing, so the message stays queued for the next one. Every
send, whether its handle times out, is dropped unwaited or is waited on, stays in flight (MPI
delivers it when the receiver receives) and the transport keeps its buffers alive until it
completes: MPI reads them until then. While any wait polls, every posted receive progresses (see
:mod:`~popmesh.engines.p2p_base`).

What a sender has in flight to each receiver is bounded (:mod:`~popmesh.engines.mpi.flow`): a frame
past its destination's window waits here, in order, and whatever popmesh call this rank makes next
(a wait, a test, a receive, a collective's wait; the heartbeat thread's polls too) posts it once
the receiver's credits open the window. Heartbeats go around the window: they must get through a
flood.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections import deque
from collections.abc import Collection
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError, MessageError, PeerFailure
from popmesh.core.handles import Completed, Pending
from popmesh.engines.base import poll_until
from popmesh.engines.envelope import INLINE_NBYTES, inline_envelope, inline_frame, parse_envelope, plan_frame
from popmesh.engines.mpi.flow import WINDOW_FRAMES, CreditCounter, SendWindow, window_nbytes
from popmesh.engines.mpi.native import load_native
from popmesh.engines.mpi.send import MpiSend, WaitingSend
from popmesh.engines.p2p_base import HEARTBEAT_TAG, TAG_LIMIT, BufferPool, Item, P2PBase, RecvRequest, buffer_cap
from popmesh.wire.format import NATIVE_DTYPE_CODES, UINT8_CODE

__all__ = ["MpiP2P"]

EXIT_GRACE_S = 30.0  # how long closing waits for sends still in flight
_KEPT_FOREVER: list[Any] = []  # buffers of sends that never completed: MPI may still read them
_IN_FLIGHT_KEPT = 256  # held sends before the completed ones behind an old one are dropped
_FAST_SPIN_S = 0.05  # base.poll_until's spin, before the general path backs off to sleeping
_SEGMENT_SPIN_S = 0.002  # a frame's segments tested back to back for this long (a 336 KB one needs ~20 us)
_CREDIT = -1  # the "tag" of a held credit send (credits are not frames; see flow)
_SEGMENT_MAX = BufferPool.MIN_NBYTES  # larger frames take the Python path: its pooled buffers save page faults
_RAW, _DECODED, _ARRIVING, _FRAME, _SHORT = 0, 1, 2, 3, 4  # what native.probe took (see _native.c)


class _Partial:
    """A frame whose envelope arrived and whose segments (of ``lengths`` bytes) are being received."""

    __slots__ = ("data", "lengths", "reqs", "src", "statuses")

    def __init__(self, src: int, data: Any, reqs: list[Any], lengths: list[int] | None = None,
                 statuses: list[Any] | None = None) -> None:
        self.src, self.data, self.reqs, self.lengths = src, data, reqs, lengths or []
        self.statuses = statuses or []


class MpiP2P(P2PBase):
    """Frames between global ranks over the engine's dedicated point-to-point communicator."""

    # MPI guarantees the bytes: "MPI provides the user with reliable message transmission. A message
    # sent is always received correctly, and the user does not need to check for transmission errors"
    # (MPI-4.1, section 2.8). So frames above the small ones carry no payload checksum by default
    # (send(checksum=True) still adds one); the header is always checked.
    payload_checksum = False

    def __init__(self, engine: Any) -> None:
        super().__init__(engine.rank, engine.size)
        self.mpi = engine._mpi
        self._comm = engine._p2p_comm
        tag_ub = self._comm.Get_attr(self.mpi.TAG_UB)
        if tag_ub is not None and tag_ub < 2 * TAG_LIMIT - 1:
            raise ConfigError(f"this MPI allows tags up to {tag_ub}; popmesh messages need {2 * TAG_LIMIT - 1}: "
                              "use another MPI build or the torch engine")
        self._status = self.mpi.Status()
        self._in_flight: deque[MpiSend] = deque()  # every send until it completes, whoever holds its handle
        self._in_flight_limit = _IN_FLIGHT_KEPT
        self._closed = False
        atexit.register(self.close)
        self._partials: dict[int, list[_Partial]] = {}
        self._pool = BufferPool()
        # flow control (see flow): windows of what this rank has in flight to each rank, frames waiting
        # behind them, and what this rank has taken from each sender; credits on their own communicator
        self._credit_comm = engine._credit_comm
        self._credit_status, self._credit_note = self.mpi.Status(), np.empty(1, dtype=np.int64)
        self._window_nbytes = window_nbytes(buffer_cap(), self.size - 1)
        self._window_frames = WINDOW_FRAMES
        self._windows: dict[int, SendWindow] = {}
        self._deferred: dict[int, deque[WaitingSend]] = {}
        self._counters: dict[int, CreditCounter] = {}
        self._native = load_native(self.mpi)  # the small messages' C path, or None (see native)
        self._handle = self._comm.py2f()
        self._short: set[int] = set()  # tags a short-path receive is on (see _enter_short)
        self._segments: list[tuple[Any, np.ndarray]] = []  # the C path's segment receives, with their buffers

    def send(self, frame: Any, dst: int, tag: int, timeout: float) -> None:
        """:meth:`P2PBase.send`, with a short path for a small one-buffer frame to another rank on a user
        tag: the window's accounting and one Isend of the envelope, completed at once when MPI sent it
        eagerly. Anything else, invalid ranks and tags included, takes the general path and its checks."""
        if type(frame) is not bytes or len(frame) > INLINE_NBYTES or not self._to_peer(dst, tag):
            return super().send(frame, dst, tag, timeout)
        env = inline_envelope(frame, tag)
        with self._lock:
            waiting = None if self._admit_now(dst, len(frame)) else self._admit([env], dst, tag, len(frame))
        if waiting is not None:
            waiting.wait(timeout)
            return None
        try:
            request = self._comm.Isend(env, dst, 2 * tag)
            if request.Test():
                return None
        except self.mpi.Exception as e:
            raise PeerFailure(f"send to rank {dst} on tag {tag} failed in MPI: {e}", (dst,)) from e
        op = MpiSend(self, [request], [env], dst, tag)
        self._hold(op)
        op.wait(timeout)
        return None

    def send_value(self, payload: Any, dst: int, tag: int, timeout: float, checksum: bool | None = None) -> bool:
        """:meth:`P2PBase.send_value` through the C path (:meth:`_post_value`); False where it does not
        take the payload. A send MPI did not complete at once is tested back to back for up to
        :data:`_SEGMENT_SPIN_S`, then waited for as any other."""
        request = self._post_value(payload, dst, tag, checksum)
        if request is False:
            return False
        if request is None or request.spin(_SEGMENT_SPIN_S):
            return True
        op = MpiSend(self, [request], [], dst, tag)
        self._hold(op)
        op.wait(timeout)
        return True

    def isend_value(self, payload: Any, dst: int, tag: int, checksum: bool | None = None) -> Pending | None:
        """:meth:`P2PBase.isend_value` through the C path (:meth:`_post_value`); None where it does not
        take the payload."""
        request = self._post_value(payload, dst, tag, checksum)
        if request is False:
            return None
        if request is None:
            return Completed()
        op = MpiSend(self, [request], [], dst, tag)
        self._hold(op)
        return op

    def _post_value(self, payload: Any, dst: int, tag: int, checksum: bool | None) -> Any:
        """The C path (:mod:`~popmesh.engines.mpi.native`) frames bytes or a C-contiguous numpy array
        below :data:`~popmesh.engines.p2p_base.BufferPool.MIN_NBYTES` and posts it, the payload as its
        own segment where it does not fit in the envelope: None when MPI completed the sends at once,
        else the native send to complete. False where it does not take the payload (anything else,
        no C path, or frames waiting behind this destination's window, which the general path queues
        behind)."""
        native = self._native
        if native is None or not self._to_peer(dst, tag):
            return False
        t = type(payload)
        if t is bytes and len(payload) < _SEGMENT_MAX:
            code: int | None = UINT8_CODE
        elif t is np.ndarray and payload.nbytes < _SEGMENT_MAX:
            code = NATIVE_DTYPE_CODES.get(payload.dtype)
        else:
            return False
        framed = None if code is None else native.envelope(payload, code, tag, bool(checksum))
        if framed is None:
            return False
        env, nbytes = framed
        with self._lock:  # admitted, then posted whole, as _isend does
            if not self._admit_now(dst, nbytes):
                return False
            try:
                return native.isend(self._handle, env, payload, code, dst, 2 * tag)
            except self.mpi.Exception as e:
                raise PeerFailure(f"send to rank {dst} on tag {tag} failed in MPI: {e}", (dst,)) from e

    def _to_peer(self, dst: Any, tag: Any) -> bool:
        """Whether a send to ``dst`` on ``tag`` may take a short path: another rank, a user tag."""
        return (type(dst) is int and type(tag) is int and dst != self.rank and 0 <= dst < self.size
                and 0 <= tag < HEARTBEAT_TAG)

    def _admit_now(self, dst: int, nbytes: int) -> bool:
        """The common case of :meth:`_admit`, without its calls (under the lock): ``dst``'s window exists,
        nothing waits behind any window, and a frame of ``nbytes`` fits; it is then counted."""
        window = self._windows.get(dst)
        if window is None or self._deferred or not window.admit(nbytes):
            return False
        if window.report_due():
            self._take_credits(dst, window)
        return True

    def recv(self, src: Any, tag: int, timeout: float) -> tuple[int, np.ndarray]:
        """:meth:`P2PBase.recv`, with a short path when this is the only receive on ``tag``, from one
        other rank, and nothing for ``tag`` is queued or half received: matched probes until the
        envelope is there, then the general path for anything but a frame carried inline. Invalid
        ranks and tags take the general path and its checks."""
        if not self._enter_short(src, tag):
            return super().recv(src, tag, timeout)
        try:
            got = self._probe_briefly(src, tag)
        finally:
            self._leave_short(tag)
        if isinstance(got, tuple):  # a frame carried inline
            return got
        return self._recv_rest(got, src, tag, timeout)

    def recv_decoded(self, src: Any, tag: int, timeout: float) -> tuple[int, Any, bool]:
        """:meth:`P2PBase.recv_decoded`: where :meth:`recv` takes its short path and the C path is there,
        the C path probes, receives and decodes a small frame (``(src, value, True)``); any other frame
        goes on as in :meth:`recv`."""
        native = self._native
        if native is None or not self._enter_short(src, tag):
            return (*self.recv(src, tag, timeout), False)
        partial: _Partial | None = None
        left = False
        try:
            got = native.probe(self._handle, src, 2 * tag, _FAST_SPIN_S, _SEGMENT_SPIN_S, _SEGMENT_MAX)
            with self._lock:  # the frame taken, its segments' receives posted, before the tag is free again
                if got is not None and got[0] == _RAW:  # the envelope, for the Python path
                    partial = self._taken(got[1], src, tag)
                elif got is not None:
                    self._took(src, tag, got[2])
                self._short.discard(tag)
                left = True
        except self.mpi.Exception as e:
            raise self._receive_failure(e, src, tag) from e
        finally:
            if not left:
                self._leave_short(tag)
        if got is None:
            return (*super().recv(src, tag, timeout), False)
        state, value, _, request, segment = got
        if partial is not None:  # _RAW
            return (*self._recv_rest(partial, src, tag, timeout), False)
        if state == _DECODED:
            return src, value, True
        if state == _ARRIVING:
            return (*self._recv_rest(self._arriving(src, value, request, segment), src, tag, timeout), False)
        if state == _SHORT:
            raise MessageError(f"from rank {src} on tag {tag}: {value}")
        return src, value, False  # _FRAME: complete, for the Python decoder

    def _arriving(self, src: int, buf: np.ndarray, request: int, segment: int) -> _Partial:
        """The frame whose segment the C path is still receiving into ``buf`` (its MPI request's Fortran
        handle ``request``). ``buf`` is also kept here until MPI completes the receive: MPI writes into
        it whatever happens to the caller meanwhile."""
        req = self.mpi.Request.f2py(request)
        null = self.mpi.REQUEST_NULL
        with self._lock:
            self._segments = [(r, b) for r, b in self._segments if r != null]
            self._segments.append((req, buf))
        return _Partial(src, buf, [req], [segment], [self.mpi.Status()])

    def _enter_short(self, src: Any, tag: Any) -> bool:
        """Start a short-path receive from ``src`` on ``tag`` where :meth:`_quick` allows it: at most one
        per tag at a time, and the general path leaves the tag alone meanwhile (:meth:`_fetch`), so no
        other receive comes between an envelope and its segment."""
        with self._lock:
            if not self._quick(src, tag) or tag in self._short:
                return False
            self._short.add(tag)
            return True

    def _leave_short(self, tag: int) -> None:
        with self._lock:
            self._short.discard(tag)

    def _quick(self, src: Any, tag: Any) -> bool:
        """Whether a receive from ``src`` on ``tag`` may take the short path: one other rank, a valid tag,
        and nothing posted, half received, queued locally or waiting behind a window."""
        return not (type(src) is not int or type(tag) is not int or src == self.rank or not 0 <= src < self.size
                    or not 0 <= tag < TAG_LIMIT or self._posted.get(tag) or self._partials.get(tag)
                    or self._local.get(tag) or self._deferred)

    def _recv_rest(self, got: _Partial | None, src: int, tag: int, timeout: float) -> tuple[int, np.ndarray]:
        """Finish a short-path receive: the frame whose envelope ``got`` holds, or the general path when
        nothing came during the spin (``got`` None) or its segments take longer."""
        if got is not None:
            if not got.reqs or self._finish_briefly(got, tag):
                if isinstance(got.data, BaseException):
                    raise got.data
                return got.src, got.data
            with self._lock:
                self._partials.setdefault(tag, []).append(got)
        return super().recv(src, tag, timeout)

    def _finish_briefly(self, partial: _Partial, tag: int) -> bool:
        """Test ``partial``'s segment receives back to back for up to :data:`_SEGMENT_SPIN_S`; True once
        they completed. A large frame moves inside MPI's progress calls, and the general path's Python
        between two of them stretched a 336 KB round trip from ~40 us (bare mpi4py calls) to ~150 us.
        No other thread sees ``partial`` yet, so no lock is needed; past the spin, the general path
        (which also advances the other tags' receives) takes over."""
        return poll_until(lambda: self._complete(partial, tag), _SEGMENT_SPIN_S, spin_s=_SEGMENT_SPIN_S)

    def _probe_briefly(self, src: int, tag: int) -> tuple[int, np.ndarray] | _Partial | None:
        """Matched probes for up to :data:`_FAST_SPIN_S` (a reply on shared memory arrives in
        microseconds): ``(src, frame)`` for a frame carried inline, the :class:`_Partial` of any other
        envelope, or None if nothing came, and the general path, with its back-off, takes over.

        This is :func:`~popmesh.engines.base.poll_until`'s spin written out: on the hot path of a
        small receive, a callback per poll cost ~0.5 us per round trip (3 %). ``src`` is one rank, so
        the status's source is not asked for."""
        until = time.perf_counter() + _FAST_SPIN_S
        polls = 0
        lock, improbe, status, mtag, byte = self._lock, self._comm.Improbe, self._status, 2 * tag, self.mpi.BYTE
        while True:
            with lock:  # one MPI status object is shared
                try:
                    message = improbe(src, mtag, status)
                    if message is not None:
                        env = np.empty(status.Get_count(byte), dtype=np.uint8)
                        message.Recv(env)
                except self.mpi.Exception as e:
                    raise self._receive_failure(e, src, tag) from e
                if message is not None:
                    frame = inline_frame(env, tag)
                    if frame is None:
                        return self._unpacked(env, src, tag)
                    self._took(src, tag, frame.size)
                    return src, frame
            polls += 1
            if polls % 32 == 0:
                if time.perf_counter() >= until:
                    return None
                os.sched_yield()

    def _post_send(self, parts: list[np.ndarray], dst: int, tag: int) -> MpiSend | WaitingSend:
        env, segments = plan_frame(parts, tag)
        buffers = [env, *segments]
        waiting = self._admit(buffers, dst, tag, parts[0].size if len(parts) == 1 else sum(p.size for p in parts))
        return self._isend(buffers, dst, tag) if waiting is None else waiting

    def _isend(self, buffers: list[Any], dst: int, tag: int) -> MpiSend:
        """Post a frame's envelope and segments (``buffers``) and hold them until MPI completes them."""
        env, segments = buffers[0], buffers[1:]
        try:
            with self._lock:  # a frame's envelope and segments go out together: another thread's frame
                reqs = [self._comm.Isend(env, dest=dst, tag=2 * tag)]  # between them would cross segments
                reqs += [self._comm.Isend(s, dest=dst, tag=2 * tag + 1) for s in segments]
        except self.mpi.Exception as e:
            raise PeerFailure(f"send to rank {dst} on tag {tag} failed in MPI: {e}", (dst,)) from e
        op = MpiSend(self, reqs, buffers, dst, tag)
        self._hold(op)
        return op

    # ---- flow control (see flow) ---------------------------------------------------------------
    def _admit(self, buffers: list[Any], dst: int, tag: int, nbytes: int) -> WaitingSend | None:
        """None when a frame of ``nbytes`` to ``dst`` may be posted now (it then counts in the window);
        otherwise the frame (``buffers``) waits behind the window, after any frame waiting already."""
        if tag == HEARTBEAT_TAG:
            return None
        with self._lock:
            window = self._windows.get(dst)
            if window is None:
                window = self._windows[dst] = SendWindow(self._window_nbytes)
            deferred = self._deferred
            if not deferred and window.admit(nbytes):  # the common case
                if window.report_due():
                    self._take_credits(dst, window)
                return None
            if dst in deferred:
                self._pump()
            if dst not in deferred:
                if window.admit(nbytes):
                    return None
                self._take_credits(dst, window)
                if window.admit(nbytes):
                    return None
            waiting = WaitingSend(self, buffers, dst, tag, nbytes)
            self._deferred.setdefault(dst, deque()).append(waiting)
            return waiting

    def _pump(self) -> None:
        """Post the frames waiting behind windows that credits have opened, oldest first per destination
        (a frame to a failed rank fails instead)."""
        with self._lock:
            if not self._deferred:
                return
            for dst, queue in list(self._deferred.items()):
                window, gone = self._windows[dst], self._gone.get(dst)
                if gone is None:
                    self._take_credits(dst, window)
                while queue and (gone is not None or window.admit(queue[0].nbytes)):
                    waiting = queue.popleft()
                    if gone is not None:
                        waiting.fail(PeerFailure(f"send to rank {dst} on tag {waiting.tag}: {gone}", (dst,)))
                        continue
                    waiting.start()
                if not queue:
                    del self._deferred[dst]

    def _take_credits(self, src: int, window: SendWindow) -> None:
        """Apply every credit from ``src`` that has arrived (each one its running count of frames taken).
        Probed by source: a probe for any source on MPICH costs more."""
        improbe, status, note = self._credit_comm.Improbe, self._credit_status, self._credit_note
        while True:
            try:
                message = improbe(src, 0, status)
                if message is None:
                    return
                message.Recv(note)
            except self.mpi.Exception:
                return  # a failed peer: its loss is found and reported elsewhere
            window.credit(int(note[0]))

    def _took(self, src: int, tag: int, nbytes: int) -> None:
        """A frame of ``nbytes`` from ``src`` on ``tag`` left MPI's queue: report to ``src`` when a credit is
        due (heartbeats go around the windows, so they count for none)."""
        if tag == HEARTBEAT_TAG:
            return
        counter = self._counters.get(src)
        if counter is None:
            counter = self._counters[src] = CreditCounter()
        taken = counter.took(nbytes)
        if taken is None:
            return
        note = np.array([taken], dtype=np.int64)
        try:
            request = self._credit_comm.Isend(note, src, 0)
            if not request.Test():
                self._hold(MpiSend(self, [request], [note], src, _CREDIT))
        except self.mpi.Exception:
            pass  # a failed peer sends nothing more

    def close(self, timeout: float = EXIT_GRACE_S) -> None:
        """Wait up to ``timeout`` s for every send in flight (receives keep progressing meanwhile), so no
        buffer MPI still reads is freed when the program ends. Sends that never complete are reported
        and their buffers kept for the life of the process. Idempotent; the engine's ``finalize`` and
        interpreter exit run it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        waiting = [w for queue in self._deferred.values() for w in queue if w.dst not in self._gone]
        pending = [op for op in self._in_flight if not op.done()]
        # heartbeats, credits and sends to failed ranks may never complete: not waited for, buffers kept
        awaited = [op for op in pending if op.tag not in (HEARTBEAT_TAG, _CREDIT) and op.dst not in self._gone]
        if awaited or waiting:
            poll_until(self._progressing(lambda: all(op.done() for op in awaited) and all(w.done() for w in waiting)),
                       timeout)
        pending += [w.op for w in waiting if w.op is not None and not w.op.done()]
        self._in_flight.clear()
        self._deferred.clear()  # never posted: MPI never read them
        _KEPT_FOREVER.extend(op for op in pending if not op.done())
        still = sorted({(op.dst, op.tag) for op in awaited if not op.done()} |
                       {(w.dst, w.tag) for w in waiting if not w.done()})
        if still:
            sys.stderr.write(f"popmesh: rank {self.rank} closes with sends still pending to (rank, tag) {still}: "
                             "their receivers never received them\n")

    def _hold(self, op: MpiSend) -> None:
        """Keep ``op`` and its buffers until MPI completes it, even when the caller drops its handle
        (MPI would otherwise read freed memory); completed sends are released oldest first."""
        with self._lock:
            in_flight = self._in_flight
            while in_flight and in_flight[0].done():
                in_flight.popleft()
            if len(in_flight) >= self._in_flight_limit:  # an old send still waits: drop the completed behind it
                self._in_flight = in_flight = deque(held for held in in_flight if not held.done())
                self._in_flight_limit = max(_IN_FLIGHT_KEPT, 2 * len(in_flight))
            in_flight.append(op)

    def memory(self) -> dict[str, int]:
        """:meth:`P2PBase.memory` plus half-received frames, the sends held until MPI completes them,
        what this rank has in flight to other ranks (frames, payload bytes, its window per rank) and the
        frames waiting behind windows. Messages not yet received wait in MPI itself (see
        docs/messages.md), not here."""
        with self._lock:
            windows = self._windows.values()
            return {**super().memory(), "partial_tags": len(self._partials),
                    "partial_frames": sum(len(p) for p in self._partials.values()),
                    "held_sends": len(self._in_flight), "in_flight_frames": sum(w.frames() for w in windows),
                    "in_flight_bytes": sum(w.in_flight for w in windows), "window_bytes": self._window_nbytes,
                    "waiting_frames": sum(len(q) for q in self._deferred.values())}

    def _progress(self) -> None:
        """:meth:`P2PBase._progress`, and post the frames that wait for room at their receivers."""
        if self._deferred:
            self._pump()
        super()._progress()

    def _poll(self, req: RecvRequest) -> bool:
        """Fast path of the matching in :meth:`P2PBase._poll` for the common case: ``req`` is the only
        receive posted on its tag, for one source or any, and no frame is half received or queued
        locally. Then one matched probe decides, with nothing to match against; else the general path."""
        if self._deferred:
            self._pump()
        with self._lock:
            if req._item is not None:
                return True
            tag, sources = req.tag, req.sources
            posted = self._posted.get(tag)
            if (posted is None or self._gone or len(posted) != 1 or posted[0]() is not req or self._partials.get(tag)
                    or self._local.get(tag) or (sources is not None and len(sources) != 1) or tag in self._short):
                return super()._poll(req)
            source = self.mpi.ANY_SOURCE if sources is None else next(iter(sources))
            if source == self.rank:
                return super()._poll(req)
            partial = self._start(source, tag)
            if partial is None:
                return False
            if not self._complete(partial, tag):
                self._partials.setdefault(tag, []).append(partial)
                return super()._poll(req)
            req._item = (partial.src, partial.data)
            posted.clear()
            del self._posted[tag]  # per-tag tables hold only tags in use
            return True

    def _fetch(self, sources: frozenset[int] | None, tag: int) -> Item | None:
        if tag in self._short:  # a short-path receive is taking this tag's next frame (see _enter_short)
            return None
        partials = self._partials.setdefault(tag, [])
        try:
            return self._fetch_from(partials, sources, tag)
        finally:
            if not partials:
                self._partials.pop(tag, None)  # per-tag tables hold only tags in use

    def _fetch_from(self, partials: list[_Partial], sources: frozenset[int] | None, tag: int) -> Item | None:
        blocked: set[int] = set()
        for partial in partials:
            if (sources is not None and partial.src not in sources) or partial.src in blocked:
                continue
            if self._complete(partial, tag):
                partials.remove(partial)
                return partial.src, partial.data
            blocked.add(partial.src)  # later frames from this sender wait for this one
        for source in _probe_order(sources, blocked, self.mpi.ANY_SOURCE):
            started = self._start(source, tag)
            if started is None:
                continue
            if started.src not in blocked and self._complete(started, tag):
                return started.src, started.data
            partials.append(started)
            blocked.add(started.src)
        gone = self._gone_error(sources)
        if gone is not None:  # nothing can arrive any more
            raise gone
        return None

    def _start(self, source: int, tag: int) -> _Partial | None:
        """Take the next envelope from ``source`` (if one is there) and post its segment receives."""
        MPI = self.mpi
        try:
            message = self._comm.Improbe(source, 2 * tag, self._status)
        except MPI.Exception as e:
            raise self._receive_failure(e, source, tag) from e
        return None if message is None else self._received(message, source, tag)

    def _received(self, message: Any, source: int, tag: int) -> _Partial:
        """Receive the envelope of the matched probe ``message`` (its status in ``self._status``); a frame
        carried whole is then complete, otherwise its segment receives are posted."""
        status = self._status
        try:
            src = status.Get_source()
            env = np.empty(status.Get_count(self.mpi.BYTE), dtype=np.uint8)
            message.Recv(env)
        except self.mpi.Exception as e:
            raise self._receive_failure(e, source, tag) from e
        return self._taken(env, src, tag)

    def _taken(self, env: np.ndarray, src: int, tag: int) -> _Partial:
        """The frame of the received envelope ``env`` (under the lock): complete when carried whole,
        otherwise with its segment receives posted."""
        frame = inline_frame(env, tag)
        if frame is not None:  # the common small message: no Envelope to build
            self._took(src, tag, frame.size)
            return _Partial(src, frame, [])
        return self._unpacked(env, src, tag)

    def _unpacked(self, env: np.ndarray, src: int, tag: int) -> _Partial:
        """The frame of a received envelope ``env`` from ``src`` that does not carry its frame whole: its
        segment receives posted, or the MessageError that replaces a malformed envelope."""
        try:
            envelope = parse_envelope(env)
            if envelope.tag != tag:
                raise MessageError(f"an envelope for tag {envelope.tag} arrived on tag {tag}")
        except MessageError as e:
            self._took(src, tag, env.size)
            return _Partial(src, MessageError(f"from rank {src} on tag {tag}: {e}"), [])
        total, inline, lengths = envelope.total, envelope.inline, envelope.lengths
        self._took(src, tag, total)
        if not lengths:
            return _Partial(src, inline, [])
        buf = self._pool.take(total, inline.size, envelope.page_offset)
        buf[:inline.size] = inline
        reqs, pos = [], inline.size
        for n in lengths:
            reqs.append(self._comm.Irecv(buf[pos:pos + n], source=src, tag=2 * tag + 1))
            pos += n
        return _Partial(src, buf, reqs, lengths, [self.mpi.Status() for _ in lengths])

    def _receive_failure(self, e: Exception, source: int, tag: int) -> PeerFailure:
        any_source = source == self.mpi.ANY_SOURCE
        suspects = [r for r in range(self.size) if r != self.rank] if any_source else [source]
        return PeerFailure(f"receiving on tag {tag} failed in MPI: {e}", suspects or [self.rank], exact=not any_source)

    def _complete(self, partial: _Partial, tag: int) -> bool:
        """Whether ``partial``'s segments have arrived; a segment shorter than its envelope announced
        replaces the frame with a MessageError (the rest of the buffer holds nothing that was sent)."""
        if not partial.reqs:
            return True
        try:
            if not self.mpi.Request.Testall(partial.reqs, partial.statuses):
                return False
            counts = [status.Get_count(self.mpi.BYTE) for status in partial.statuses]
        except self.mpi.Exception as e:
            partial.data, partial.reqs = PeerFailure(f"receiving a frame from rank {partial.src} on tag {tag} "
                                                     f"failed in MPI: {e}", (partial.src,)), []
            return True
        if counts != partial.lengths:
            partial.data = MessageError(f"from rank {partial.src} on tag {tag}: a frame's segments of {counts} bytes "
                                        f"arrived where its envelope announced {partial.lengths}")
        partial.reqs = []
        return True


def _probe_order(sources: Collection[int] | None, blocked: set[int], any_source: int) -> list[int]:
    if sources is None:
        return [any_source]
    return [s for s in sorted(sources) if s not in blocked] + [s for s in sorted(sources) if s in blocked]
