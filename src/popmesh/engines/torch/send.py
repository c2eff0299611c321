"""The sending half of the gloo point-to-point transport: buffers as tensors, sends in flight, and
the per-channel threads that complete them (see :mod:`popmesh.engines.torch.p2p`).

A gloo send whose timed ``wait`` expires closes the connection, so no caller ever waits on a gloo
send with a deadline: each (destination, tag) channel has a daemon thread that completes its sends
in order, and callers wait on an event with their own timeout. Frames carried whole in their
envelope (up to 512 KiB) are sent eagerly: the caller returns once the envelope (popmesh's own
copy) is handed to gloo, as long as the channel holds at most 256 such sends and 16 MiB; the
channel thread reaps them in batches every :data:`REAP_S` seconds, and a failure surfaces at the
next send on the channel.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from datetime import timedelta
from typing import Any

import numpy as np

from popmesh.core.errors import CommTimeout, PeerFailure, PopmeshError

__all__ = ["LONG", "REAP_S", "TorchSend", "Outbox", "failure", "is_gone", "tensor"]

LONG = timedelta(days=30)  # gloo closes the connection when a wait expires: never let one expire
REAP_S = 0.05
_IDLE_S = 5.0
_EAGER_BACKLOG = 256
_EAGER_NBYTES = 16 << 20  # what 256 envelopes of 64 KiB held before gloo inlined larger frames
_ZERO_COPY_MIN = 1 << 16
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


class TorchSend:
    """One frame in flight; its buffers live until the channel thread has seen it complete."""

    def __init__(self, works: list[Any], keep: list[np.ndarray | bytearray], eager: bool, outbox: Outbox) -> None:
        self._works: list[Any] | None = works
        self._keep: list[np.ndarray | bytearray] | None = keep
        self.nbytes = sum(len(b) for b in keep)
        self.eager, self.outbox = eager, outbox
        self.error: PopmeshError | None = None
        self._event = threading.Event()

    def complete(self) -> None:
        try:
            for work in self._works or ():
                work.wait(LONG)
        except RuntimeError as e:
            self.error = failure(e, f"send to rank {self.outbox.dst} on tag {self.outbox.tag}", self.outbox.dst)
        finally:
            self._works = self._keep = None
            self._event.set()

    def done(self) -> bool:
        """Complete, or (eager) our own copy is with gloo and the channel's backlog is bounded."""
        return self._event.is_set() or (self.eager and self.outbox.bounded())

    def wait(self, timeout: float) -> None:
        if self.done() and not self._event.is_set():
            return
        self.outbox.hurry()
        if not self._event.wait(timeout):
            raise CommTimeout(
                f"send to rank {self.outbox.dst} on tag {self.outbox.tag} did not complete within {timeout:g} s: "
                "that rank has not received on this tag. The message stays in flight and is delivered when it "
                "does; leave the payload's arrays unchanged until then.", (self.outbox.dst,))
        if self.error is not None:
            raise self.error


class Outbox:
    """The sends of one (destination, tag) channel, completed in order by one daemon thread.

    The thread wakes at once for a send someone waits on; eager sends are reaped every ``REAP_S``
    seconds, by when their waits return at once (so a small send costs no thread wake-up).
    """

    def __init__(self, dst: int, tag: int) -> None:
        self.dst, self.tag = dst, tag
        self.error: PopmeshError | None = None
        self._ops: deque[TorchSend] = deque()
        self._queued_nbytes = 0
        self._awaited = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def backlog(self) -> int:
        return len(self._ops)

    def bounded(self) -> bool:
        """The queued eager sends are few and small enough to let their callers go on (at most
        :data:`_EAGER_BACKLOG` frames and :data:`_EAGER_NBYTES` bytes held for gloo)."""
        return len(self._ops) <= _EAGER_BACKLOG and self._queued_nbytes <= _EAGER_NBYTES

    def push(self, op: TorchSend) -> None:
        with self._cond:
            self._ops.append(op)
            self._queued_nbytes += op.nbytes
            self._awaited += not op.eager
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"popmesh-p2p-send-{self.dst}-{self.tag}",
                                                daemon=True)
                self._thread.start()
            elif self._urgent():
                self._cond.notify()

    def hurry(self) -> None:
        """Someone waits for this channel's sends: complete them now."""
        with self._cond:
            self._awaited += 1
            self._cond.notify()

    def _urgent(self) -> bool:
        return self._awaited > 0 or len(self._ops) > _EAGER_BACKLOG // 2 or self._queued_nbytes > _EAGER_NBYTES // 2

    def _batch(self) -> int:
        """How many queued sends to complete now (0: the channel went idle and the thread ends)."""
        with self._cond:
            if not self._ops:
                self._cond.wait(_IDLE_S)
                if not self._ops:
                    self._thread, self._awaited = None, 0
                    return 0
            if not self._urgent():
                self._cond.wait(REAP_S)
            return len(self._ops)

    def _run(self) -> None:
        while batch := self._batch():
            for _ in range(batch):  # only this thread removes sends, so the first ``batch`` stay put
                op = self._ops[0]
                op.complete()
                with self._cond:
                    self._ops.popleft()
                    self._queued_nbytes -= op.nbytes
                    self._awaited = max(0, self._awaited - (not op.eager)) if self._ops else 0
                    if op.error is not None and op.eager:
                        self.error = op.error
