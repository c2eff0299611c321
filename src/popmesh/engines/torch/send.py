"""The sending half of the gloo point-to-point transport: buffers as tensors, sends in flight, and
the per-channel threads that complete them (see :mod:`popmesh.engines.torch.p2p`).

A gloo send whose timed ``wait`` expires closes the connection, so no caller ever waits on a gloo
send with a deadline: a few worker threads per rank (:class:`SendWorkers`, at most
:data:`SEND_THREADS` whatever the number of peers and tags) complete each (destination, tag)
channel's sends in order, and callers wait on an event with their own timeout. Frames carried whole in their
envelope (up to 512 KiB) are sent eagerly: the caller returns once the envelope (popmesh's own
copy) is handed to gloo, as long as the channel holds at most 256 such sends and 16 MiB; a worker
reaps them in batches every :data:`REAP_S` seconds, and a failure surfaces at the next send on the
channel.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from typing import Any

import numpy as np

from popmesh.core.errors import CommTimeout, PeerFailure, PopmeshError

__all__ = ["LONG", "REAP_S", "SEND_THREADS", "EAGER_TOTAL_NBYTES", "RECYCLE_NBYTES", "TorchSend", "Outbox",
           "SendBuffers", "SendWorkers", "failure", "is_gone", "tensor"]

LONG = timedelta(days=30)  # gloo closes the connection when a wait expires: never let one expire
REAP_S = 0.05
SEND_THREADS = 4  # completion workers per rank, whatever the number of peers and tags
_IDLE_S = 5.0
_EAGER_BACKLOG = 256
_EAGER_NBYTES = 16 << 20  # what 256 envelopes of 64 KiB held before gloo inlined larger frames
EAGER_TOTAL_NBYTES = 64 << 20  # queued send bytes per rank, all channels together, past which sends wait
_ZERO_COPY_MIN = 1 << 16
RECYCLE_MIN = 1 << 16  # envelope buffers from this size on are recycled (SendBuffers)
RECYCLE_STEP = 1 << 16  # ... in size classes of this many bytes
RECYCLE_NBYTES = 16 << 20  # idle recycled envelope buffers kept per rank, at most
_GONE = ("connection closed", "connection reset", "broken pipe", "socket closed", "connection refused",
         "pair closure", "closed by peer")


def is_gone(e: BaseException) -> bool:
    return any(m in str(e).lower() for m in _GONE)


def failure(e: BaseException, what: str, rank: int) -> PopmeshError:
    if is_gone(e):
        return PeerFailure(f"{what}: rank {rank} closed its connection (did it die?): {e}", (rank,))
    return PopmeshError(f"{what} failed in torch.distributed: {e}")


def tensor(buf: np.ndarray | bytearray) -> Any:
    """A uint8 CPU tensor over ``buf``'s memory. Torch warns about read-only buffers, and silencing the
    warning costs more than a small send, so small read-only buffers are copied instead."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    if isinstance(buf, bytearray):
        return _torch.frombuffer(buf, dtype=_torch.uint8) if buf else _torch.empty(0, dtype=_torch.uint8)
    if buf.flags.writeable:
        return _torch.from_numpy(buf)
    if buf.size < _ZERO_COPY_MIN:
        return _torch.from_numpy(buf.copy())
    with warnings.catch_warnings():  # a big read-only payload: no copy (gloo only reads a send buffer)
        warnings.simplefilter("ignore", UserWarning)
        return _torch.from_numpy(buf)


_torch: Any = None


class SendBuffers:
    """Envelope buffers of eager sends, recycled once gloo has completed the send that used them.

    An eager frame is copied into its envelope so that ``send`` returns at once. The send workers
    complete eager sends only every :data:`REAP_S`, so a ping-pong has dozens in flight, and a fresh
    336 KB buffer per send was mostly page faults (213 us for the copy on the 2-vCPU development VM,
    ~20x a copy into memory already mapped): the memory went back to the OS between sends. Buffers of
    :data:`RECYCLE_MIN` bytes or more come in size classes of :data:`RECYCLE_STEP` and return to a
    free list when their send completes, up to :data:`RECYCLE_NBYTES` idle per rank.
    """

    def __init__(self, cap: int = RECYCLE_NBYTES) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle, self._cap = 0, cap
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer of ``nbytes`` (a view of a recycled one from :data:`RECYCLE_MIN` on)."""
        if nbytes < RECYCLE_MIN:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // RECYCLE_STEP) * RECYCLE_STEP
        with self._lock:
            free = self._free.get(size)
            base = free.pop() if free else None
            if base is not None:
                self._idle -= size
        return (np.empty(size, dtype=np.uint8) if base is None else base)[:nbytes]

    def base(self, buf: np.ndarray | bytearray) -> np.ndarray | None:
        """The recycled buffer ``buf`` (from :meth:`take`) is a view of, or None."""
        base = getattr(buf, "base", None)
        return base if isinstance(base, np.ndarray) and base.size >= RECYCLE_MIN and base.base is None else None

    def give_back(self, base: np.ndarray) -> None:
        """``base`` (from :meth:`base`) is no longer read by gloo: keep it for a later send, within the cap."""
        with self._lock:
            if self._idle + base.size <= self._cap:
                self._free.setdefault(base.size, []).append(base)
                self._idle += base.size

    def idle_nbytes(self) -> int:
        return self._idle


class TorchSend:
    """One frame in flight; its buffers live until the channel thread has seen it complete."""

    def __init__(self, works: list[Any], keep: list[np.ndarray | bytearray], eager: bool, outbox: Outbox,
                 recycle: tuple[SendBuffers, np.ndarray] | None = None) -> None:
        self._works: list[Any] | None = works
        self._keep: list[np.ndarray | bytearray] | None = keep
        self.nbytes = sum(len(b) for b in keep)
        self.eager, self.outbox = eager, outbox
        self.error: PopmeshError | None = None
        self._recycle = recycle  # (pool, buffer): given back once the send completed without error
        self._event = threading.Event()

    def complete(self) -> None:
        try:
            for work in self._works or ():
                work.wait(LONG)
        except RuntimeError as e:
            self.error = failure(e, f"send to rank {self.outbox.dst} on tag {self.outbox.tag}", self.outbox.dst)
            self._recycle = None  # gloo may not be done with it: never reuse
        finally:
            self._works = self._keep = None
            if self._recycle is not None:
                pool, base = self._recycle
                self._recycle = None
                pool.give_back(base)
            self._event.set()

    def abandon(self, error: PopmeshError) -> None:
        """Fail this send now (its receiver failed); its buffers stay referenced, never reused."""
        self.error, self._recycle = error, None
        self._event.set()

    def done(self) -> bool:
        """Complete, or (eager) our own copy is with gloo and the channel's backlog is bounded."""
        return self._event.is_set() or (self.eager and self.outbox.bounded())

    def wait(self, timeout: float) -> None:
        if self.done() and not self._event.is_set():
            return
        if not self._event.is_set():  # completed (or abandoned) sends need no worker
            self.outbox.hurry()
        if not self._event.wait(timeout):
            raise CommTimeout(
                f"send to rank {self.outbox.dst} on tag {self.outbox.tag} did not complete within {timeout:g} s: "
                "that rank has not received on this tag. The message stays in flight and is delivered when it "
                "does; leave the payload's arrays unchanged until then.", (self.outbox.dst,))
        if self.error is not None:
            raise self.error


class Outbox:
    """The sends of one (destination, tag) channel, completed in order by the transport's :class:`SendWorkers`.

    A worker takes the channel at once when someone waits on one of its sends; eager sends are
    reaped after ``REAP_S`` seconds, by when their waits return at once (so a small send costs no
    thread wake-up). A channel is served by one worker at a time, which keeps its order.
    """

    def __init__(self, dst: int, tag: int, workers: SendWorkers | None = None) -> None:
        self.dst, self.tag = dst, tag
        self.error: PopmeshError | None = None
        self.workers = SendWorkers() if workers is None else workers
        self._ops: deque[TorchSend] = deque()
        self._queued_nbytes = 0
        self._awaited = 0
        self._due = 0.0  # when the oldest eager send is to be reaped
        self._serving = False  # a worker is completing this channel's sends
        self._server: threading.Thread | None = None  # that worker
        self.abandoned: PopmeshError | None = None  # its receiver failed: see SendWorkers.abandon

    def backlog(self) -> int:
        return len(self._ops)

    def is_abandoned(self) -> bool:
        """Whether its receiver failed (SendWorkers.abandon): its sends failed, none are taken."""
        return self.abandoned is not None

    def bounded(self) -> bool:
        """The queued eager sends are few and small enough to let their callers go on (at most
        :data:`_EAGER_BACKLOG` frames and :data:`_EAGER_NBYTES` bytes held for gloo)."""
        return (len(self._ops) <= _EAGER_BACKLOG and self._queued_nbytes <= _EAGER_NBYTES
                and self.workers.eager_nbytes() <= EAGER_TOTAL_NBYTES)

    def push(self, op: TorchSend) -> None:
        self.workers.push(self, op)

    def hurry(self) -> None:
        """Someone waits for this channel's sends: complete them now."""
        self.workers.hurry(self)

    def _urgent(self) -> bool:
        return (self._awaited > 0 or len(self._ops) > _EAGER_BACKLOG // 2 or self._queued_nbytes > _EAGER_NBYTES // 2
                or self.workers.eager_nbytes() > EAGER_TOTAL_NBYTES // 2)

    def _ready(self, now: float) -> bool:
        return bool(self._ops) and not self._serving and (self._urgent() or now >= self._due)


class SendWorkers:
    """At most :data:`SEND_THREADS` daemon threads that complete every channel's sends, whatever the
    number of peers and tags: a worker takes one channel with work, completes the sends queued
    there in order, and looks for the next. Workers start on demand, end after ``_IDLE_S`` idle
    seconds, and :meth:`close` ends them for good. More than one worker, so a send held up by one
    slow receiver does not hold up the completion of sends to the others.
    """

    def __init__(self, threads: int = 0) -> None:
        self._max = threads or SEND_THREADS
        self._cond = threading.Condition()
        self._boxes: list[Outbox] = []  # channels with sends queued
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._wakeup = 0.0  # when the idle workers wake up next by themselves
        self._closed = False
        self._queued = 0  # bytes queued on every channel together (bounded: see Outbox.bounded)
        self._abandoned: list[TorchSend] = []  # sends to failed receivers: their buffers stay with gloo

    def push(self, box: Outbox, op: TorchSend) -> None:
        with self._cond:
            if box.abandoned is not None:  # its receiver failed while this send was posted
                op.abandon(box.abandoned)
                self._abandoned.append(op)
                return
            if not box._ops:
                box._due = time.monotonic() + REAP_S
                self._boxes.append(box)
            box._ops.append(op)
            box._queued_nbytes += op.nbytes
            self._queued += op.nbytes
            box._awaited += not op.eager
            self._wake(box)

    def eager_nbytes(self) -> int:
        """Bytes queued on every channel together (read without the lock: a snapshot)."""
        return self._queued

    def hurry(self, box: Outbox) -> None:
        with self._cond:
            box._awaited += 1
            self._wake(box)

    def _wake(self, box: Outbox) -> None:
        """Let a worker see ``box`` (start one if none is idle and the cap allows)."""
        if self._idle == 0 and len(self._threads) < self._max and not self._closed:
            thread = threading.Thread(target=self._run, name="popmesh-p2p-send", daemon=True)
            self._threads.append(thread)
            thread.start()
        elif box._urgent() or box._due < self._wakeup:
            self._cond.notify()

    def abandon(self, boxes: list[Outbox], error: PopmeshError) -> None:
        """The receiver of ``boxes`` failed: their sends fail with ``error`` now, and nothing waits on them.

        gloo does not always end a send whose receiver died: a send it queued to retry when the
        connection broke is never signalled when it then sees the connection closed, and its ``wait``
        never returns. So a worker completing such a channel is let go (it ends if gloo ever returns,
        and no longer counts against :data:`SEND_THREADS` or :meth:`close`), and every send of the
        channel is failed and kept: gloo may still hold its buffers, which are never reused.
        """
        with self._cond:
            for box in boxes:
                if box.abandoned is not None:
                    continue
                box.abandoned = error
                for op in box._ops:
                    op.abandon(error)
                self._abandoned.extend(box._ops)
                self._queued -= box._queued_nbytes
                box._ops.clear()
                box._queued_nbytes = box._awaited = 0
                if box in self._boxes:
                    self._boxes.remove(box)
                if box._server is not None and box._server in self._threads:
                    self._threads.remove(box._server)
                box._serving, box._server = False, None
            if self._boxes:  # the let-go workers' places are free again for the other channels
                self._wake(self._boxes[0])

    def close(self, timeout: float) -> None:
        """End every worker once the queued sends are done (or ``timeout`` passed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _next(self) -> Outbox | None:
        """The next channel to serve, marked as served; None when this worker is to end."""
        with self._cond:
            while True:
                now = time.monotonic()
                box = next((b for b in self._boxes if b._ready(now)), None)
                if box is not None:
                    box._serving, box._server = True, threading.current_thread()
                    return box
                if self._closed and not any(b._ops for b in self._boxes):
                    break
                waiting = [b._due for b in self._boxes if not b._serving]
                pause = min(waiting) - now if waiting else _IDLE_S
                self._idle += 1
                self._wakeup = now + pause
                woken = self._cond.wait(max(pause, 0.001))
                self._idle -= 1
                if not woken and not self._boxes and not self._closed:
                    break  # idle for _IDLE_S
            self._threads.remove(threading.current_thread())
            return None

    def _run(self) -> None:
        while (box := self._next()) is not None:
            if not self._serve(box):
                return  # let go while gloo held it (abandon): no longer one of the workers

    def _serve(self, box: Outbox) -> bool:
        """Complete the sends queued on ``box`` now; False if the channel was abandoned meanwhile."""
        with self._cond:  # only this worker removes sends (or abandon, which then lets it go)
            batch = list(box._ops)
        for op in batch:
            op.complete()
            with self._cond:
                if box.is_abandoned():  # while gloo held this worker
                    return False
                box._ops.popleft()
                box._queued_nbytes -= op.nbytes
                self._queued -= op.nbytes
                box._awaited = max(0, box._awaited - (not op.eager)) if box._ops else 0
                if op.error is not None and op.eager:
                    box.error = op.error
        with self._cond:
            if box.is_abandoned():
                return False
            box._serving, box._server = False, None
            if box._ops:
                box._due = time.monotonic() + REAP_S
                self._cond.notify()
            else:
                self._boxes.remove(box)
        return True
