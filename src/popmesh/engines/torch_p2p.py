"""Point-to-point frames over torch.distributed (gloo) on global ranks.

Every frame travels as an :mod:`~popmesh.engines.envelope` on an internal envelope tag, then its
payload segments on the sibling payload tag; both are derived from the user tag and kept away from
small tags a program may use with ``dist.send`` itself. Bytes are raw: nothing is ever value-cast.

Why threads: a gloo receive whose ``wait(timeout)`` expires closes the connection ("Application
timeout caused pair closure"), and gloo offers no non-blocking completion test. So each tag a rank
receives on gets one daemon *pump* thread that keeps an any-source envelope receive posted (a
timeout then never touches gloo: the caller just stops waiting, and a late message is queued for the
next receive), and each (destination, tag) channel gets a daemon thread that waits for its sends to
complete (so a send timeout leaves the message in flight instead of breaking the connection).

Small frames are sent eagerly: ``send`` returns once the envelope (our own copy) is handed to gloo,
and the channel thread reaps such sends in the background every :data:`_REAP_S` seconds; if one
failed, the next send on the channel raises the error. A dead peer surfaces as PeerFailure when gloo
reports the closed connection, and on a receive timeout a zero-byte probe tells a dead source
(PeerFailure) from a silent one (CommTimeout). Pump threads end with the process.

Shutdown rule: gloo moves a message only while both ends are alive, and a gloo wait that returns to
a Python thread while the interpreter is finalizing aborts the process ("terminate called without
an active exception"; gloo's abort cannot wake such waits). So at exit this transport waits up to
:data:`EXIT_GRACE_S` for its pending sends to complete, it never holds the process group itself
(that kept gloo's collective worker threads alive into shutdown, where they abort), and a program
should let a rank exit only once every message sent *to* it has been received.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from typing import Any

import numpy as np

from ..errors import CommTimeout, ConfigError, MessageError, PeerFailure, PopmeshError
from .envelope import ENVELOPE_NBYTES, parse_envelope, plan_frame
from .p2p_base import BufferPool, Item, P2PBase, RecvRequest

__all__ = ["TorchP2P", "EXIT_GRACE_S"]

_TAG_BASE = 1 << 20  # envelope tag = base + 2 * tag, payload tag = base + 2 * tag + 1
_PING_TAG = _TAG_BASE - 1
_LONG = timedelta(days=30)  # gloo closes the connection when a wait expires: never let one expire
_IDLE_S = 5.0
_REAP_S = 0.05
EXIT_GRACE_S = 30.0
_EAGER_BACKLOG = 256
_GONE = ("connection closed", "connection reset", "broken pipe", "socket closed", "connection refused",
         "pair closure", "closed by peer")


def _env_tag(tag: int) -> int:
    return _TAG_BASE + 2 * tag


def _is_gone(e: BaseException) -> bool:
    return any(m in str(e).lower() for m in _GONE)


def _failure(e: BaseException, what: str, rank: int) -> PopmeshError:
    if _is_gone(e):
        return PeerFailure(f"{what}: rank {rank} closed its connection (did it die?): {e}", (rank,))
    return PopmeshError(f"{what} failed in torch.distributed: {e}")


def _source_rank(work: Any) -> int:
    """The sender of an any-source receive (``source_rank`` warns that it is deprecated; same value)."""
    getter = getattr(work, "_source_rank", None) or work.source_rank
    return int(getter())


def _tensor(arr: np.ndarray) -> Any:
    import torch

    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():  # gloo only reads a send buffer
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class _TorchSend:
    """One frame in flight; its buffers live until the channel thread has seen it complete."""

    def __init__(self, works: list[Any], keep: list[np.ndarray], eager: bool, outbox: _Outbox) -> None:
        self._works: list[Any] | None = works
        self._keep: list[np.ndarray] | None = keep
        self.eager, self.outbox = eager, outbox
        self.error: PopmeshError | None = None
        self._event = threading.Event()

    def complete(self) -> None:
        try:
            for work in self._works or ():
                work.wait(_LONG)
        except RuntimeError as e:
            self.error = _failure(e, f"send to rank {self.outbox.dst} on tag {self.outbox.tag}", self.outbox.dst)
        finally:
            self._works = self._keep = None
            self._event.set()

    def done(self) -> bool:
        """Complete, or (eager) our own copy is with gloo and the channel's backlog is bounded."""
        return self._event.is_set() or (self.eager and self.outbox.backlog() <= _EAGER_BACKLOG)

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


class _Outbox:
    """The sends of one (destination, tag) channel, completed in order by one daemon thread.

    The thread wakes at once for a send someone waits on; eager sends are reaped every ``_REAP_S``
    seconds, by when their waits return at once (so a small send costs no thread wake-up).
    """

    def __init__(self, dst: int, tag: int) -> None:
        self.dst, self.tag = dst, tag
        self.error: PopmeshError | None = None
        self._ops: deque[_TorchSend] = deque()
        self._awaited = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def backlog(self) -> int:
        return len(self._ops)

    def push(self, op: _TorchSend) -> None:
        with self._cond:
            self._ops.append(op)
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
        return self._awaited > 0 or len(self._ops) > _EAGER_BACKLOG // 2

    def _next(self) -> _TorchSend | None:
        with self._cond:
            if not self._ops:
                self._cond.wait(_IDLE_S)
                if not self._ops:
                    self._thread, self._awaited = None, 0
                    return None
            if not self._urgent():
                self._cond.wait(_REAP_S)
            return self._ops[0]

    def _run(self) -> None:
        while (op := self._next()) is not None:
            op.complete()
            with self._cond:
                self._ops.popleft()
                self._awaited = max(0, self._awaited - (not op.eager)) if self._ops else 0
                if op.error is not None and op.eager:
                    self.error = op.error


class TorchP2P(P2PBase):
    """Frames between global ranks of the default torch.distributed group (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        import torch.distributed as dist

        super().__init__(engine.rank, engine.size)
        self._group = dist.group
        self._cond = threading.Condition(self._lock)
        self._inbox: dict[int, deque[Item]] = {}
        self._pumps: dict[int, threading.Thread] = {}
        self._broken: dict[int, PopmeshError] = {}
        self._outboxes: dict[tuple[int, int], _Outbox] = {}
        self._post_lock = threading.Lock()
        self._pool = BufferPool()
        self._pings: list[Any] = []
        atexit.register(self._flush_at_exit)

    @property
    def _pg(self) -> Any:
        """The default process group, looked up on every use: holding it would keep it (and gloo's
        collective worker threads) alive into interpreter shutdown, where they abort the process."""
        pg = self._group.WORLD
        if pg is None:
            raise ConfigError("the torch world was finalized: point-to-point messages need a live world")
        return pg

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

    def _flush_at_exit(self) -> None:
        busy = self.flush(EXIT_GRACE_S)
        if busy:
            sys.stderr.write(f"popmesh: rank {self.rank} exits with sends still pending to (rank, tag) {busy}: "
                             "their receivers never received them\n")

    # ---- sending -----------------------------------------------------------------------------
    def _post_send(self, parts: list[np.ndarray], dst: int, tag: int) -> _TorchSend:
        outbox = self._outbox(dst, tag)
        if outbox.error is not None:
            error, outbox.error = outbox.error, None
            raise PeerFailure(f"an earlier send to rank {dst} on tag {tag} failed: {error}", (dst,)) from error
        env, segments = plan_frame(parts)
        try:
            pg = self._pg
            with self._post_lock:
                works = [pg.send([_tensor(env)], dst, _env_tag(tag))]
                works += [pg.send([_tensor(s)], dst, _env_tag(tag) + 1) for s in segments]
        except RuntimeError as e:
            raise _failure(e, f"send to rank {dst} on tag {tag}", dst) from e
        op = _TorchSend(works, [env, *segments], not segments, outbox)
        outbox.push(op)
        return op

    def _outbox(self, dst: int, tag: int) -> _Outbox:
        with self._lock:
            box = self._outboxes.get((dst, tag))
            if box is None:
                box = self._outboxes[(dst, tag)] = _Outbox(dst, tag)
            return box

    # ---- receiving ---------------------------------------------------------------------------
    def _fetch(self, sources: frozenset[int] | None, tag: int) -> Item | None:
        if tag not in self._pumps:
            self._pumps[tag] = threading.Thread(target=self._pump, args=(tag,), name=f"popmesh-p2p-recv-{tag}",
                                                daemon=True)
            self._pumps[tag].start()
        queue = self._inbox.get(tag)
        for i, item in enumerate(queue or ()):
            if sources is None or item[0] in sources:
                del queue[i]  # type: ignore[union-attr]
                return item
        if tag in self._broken:
            raise self._broken[tag]
        return None

    def _block(self, req: RecvRequest, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._poll(req):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _pump(self, tag: int) -> None:
        """Keep one any-source envelope receive posted on ``tag``; queue every frame that arrives."""
        while True:
            env = np.empty(ENVELOPE_NBYTES, dtype=np.uint8)
            try:
                work = self._pg.recv_anysource([_tensor(env)], _env_tag(tag))
                work.wait(_LONG)
                src = _source_rank(work)
            except (RuntimeError, ConfigError) as e:
                with self._cond:
                    self._broken[tag] = PopmeshError(f"receiving on tag {tag} stopped in torch.distributed: {e}")
                    self._cond.notify_all()
                return
            item = self._receive_rest(env, src, tag)
            with self._cond:
                self._inbox.setdefault(tag, deque()).append(item)
                self._cond.notify_all()

    def _receive_rest(self, env: np.ndarray, src: int, tag: int) -> Item:
        try:
            total, inline, lengths = parse_envelope(env)
        except MessageError as e:
            return src, MessageError(f"from rank {src} on tag {tag}: {e}")
        if not lengths:
            return src, inline
        buf = self._pool.take(total)
        buf[:inline.size] = inline
        pos = inline.size
        try:
            for n in lengths:
                self._pg.recv([_tensor(buf[pos:pos + n])], src, _env_tag(tag) + 1).wait(_LONG)
                pos += n
        except (RuntimeError, ConfigError) as e:
            return src, _failure(e, f"receiving a frame from rank {src} on tag {tag}", src)
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
        try:
            self._pings.append(self._pg.send([_tensor(np.empty(0, dtype=np.uint8))], rank, _PING_TAG))
        except RuntimeError as e:
            return not _is_gone(e)
        return True
