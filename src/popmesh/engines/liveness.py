"""Heartbeats: a frozen or dead rank is found within seconds, whatever the operation timeout.

A blocking call's own timeout (300 s by default) is far too long to wait for a rank that was
SIGSTOPped, whose host froze, or that died where no launcher tears the world down (ranks started by
a batch system). So every rank of a world of two or more runs one daemon thread that sends a small
*beat* to its ring successor every ``interval`` seconds and watches the beats of its ring
predecessor, on a point-to-point tag of its own (:data:`HEARTBEAT_TAG`). A predecessor silent for
``timeout`` seconds is declared failed: the watcher tells every other rank (a *notice*), and each
rank hands the failure to its engine, which ends what waits on that rank (gloo: the connection to
it is closed, so a collective blocked in gloo fails at once; MPI: polling waits raise) with a
PeerFailure naming it. A rank that finalizes sends *bye* first, so its successor stops watching.

Any run of failed ranks is found by the live rank after its last member, so at least one
survivor always notices; with the default 20 s timeout and 1 s beats, every rank knows within
about 22 s. The ring then closes over the failed ranks (each survivor beats to, and watches, the
nearest live rank), so survivors that go on without a lost rank (``world.survivors()``) still find
a second loss among them. ``POPMESH_HEARTBEAT_TIMEOUT`` sets the timeout (0 turns heartbeats off, for example
while a debugger holds a rank).

A rank that dies of an uncaught exception does not wait to be found: it sends every peer a *failing*
note with its error (:mod:`popmesh.engines.failing`), and each peer hands the failure to its engine
at once and is taken down with it (:func:`~popmesh.engines.failing.take_down`) unless it ends by
itself within :data:`TAKE_DOWN_S` seconds (or the heartbeat's timeout, if shorter).

The watch itself (:class:`RingWatch`) is pure: it is fed arrivals and the clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError, PeerClosed, PeerFailure, PopmeshError
from popmesh.core.launch_env import read_number
from popmesh.engines import failing
from popmesh.engines.p2p_base import HEARTBEAT_TAG

__all__ = [
    "HEARTBEAT_TAG", "DEFAULT_TIMEOUT_S", "TAKE_DOWN_S", "RingWatch", "Heartbeat", "start_heartbeat",
    "heartbeat_timeout", "beat_interval",
    "encode_note", "decode_note", "failing_note", "note_text",
]

DEFAULT_TIMEOUT_S = 20.0
TAKE_DOWN_S = 5.0  # how long a peer of a failing rank may take to end by itself
ANNOUNCE_S = 2.0  # how long a failing rank waits for its failing notes to leave
BEAT, BYE, NOTICE, FAILING = 1, 2, 3, 4
_MAGIC = 0x504D4842  # "PMHB"
_HEADER_NBYTES = 40
_TEXT_NBYTES = 512


def heartbeat_timeout() -> float:
    """Seconds of silence after which a rank is declared failed (``POPMESH_HEARTBEAT_TIMEOUT``; 0: off)."""
    return read_number("POPMESH_HEARTBEAT_TIMEOUT", DEFAULT_TIMEOUT_S, hint="give seconds (0 turns heartbeats off)")


def beat_interval(timeout: float) -> float:
    """How often to beat: a twentieth of the timeout, between 0.1 and 1 s."""
    return min(1.0, max(0.1, timeout / 20))


def encode_note(kind: int, rank: int, about: int = -1, silent_s: float = 0.0) -> np.ndarray:
    """One heartbeat message: ``[magic, kind, sender, rank it is about, silence in ms]`` as int64."""
    return np.array([_MAGIC, kind, rank, about, round(silent_s * 1000)], dtype=np.int64)


def failing_note(rank: int, text: str) -> np.ndarray:
    """The note of rank ``rank`` failing with ``text`` (its error): a header, then the text in UTF-8."""
    body = text.encode("utf-8", errors="replace")[:_TEXT_NBYTES]
    return np.concatenate([encode_note(FAILING, rank, rank).view(np.uint8), np.frombuffer(body, dtype=np.uint8)])


def decode_note(frame: Any) -> tuple[int, int, int, float]:
    """``(kind, sender, about, silent seconds)``; ConfigError for anything else. Only a failing note
    carries more than the header (its text: :func:`note_text`)."""
    raw = np.asarray(frame, dtype=np.uint8).reshape(-1)
    if raw.size < _HEADER_NBYTES:
        raise ConfigError(f"not a heartbeat message ({raw.size} bytes): another program uses popmesh's tag")
    note = raw[:_HEADER_NBYTES].view(np.int64)
    kind = int(note[1])
    if int(note[0]) != _MAGIC or kind not in (BEAT, BYE, NOTICE, FAILING) or (
            raw.size > _HEADER_NBYTES and kind != FAILING):
        raise ConfigError("not a heartbeat message: another program uses popmesh's tag")
    return kind, int(note[2]), int(note[3]), int(note[4]) / 1000


def note_text(frame: Any) -> str:
    """The error text of a failing note ("" for the other kinds)."""
    return np.asarray(frame, dtype=np.uint8).reshape(-1)[_HEADER_NBYTES:].tobytes().decode("utf-8", errors="replace")


@dataclass
class RingWatch:
    """What rank ``rank`` of ``size`` knows: when its predecessor last beat, and who failed."""

    rank: int
    size: int
    timeout: float
    started: float
    last_seen: float = field(init=False)
    finished: bool = False  # the predecessor said bye (or closed in order): nothing more to watch
    failed: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.last_seen = self.started

    @property
    def predecessor(self) -> int:
        """The nearest rank before this one in the ring that is not known failed: the one it watches."""
        return self._nearest(-1)

    @property
    def successor(self) -> int:
        """The nearest rank after this one that is not known failed: the one its beats go to."""
        return self._nearest(1)

    def _nearest(self, step: int) -> int:
        for hop in range(1, self.size):
            other = (self.rank + step * hop) % self.size
            if other not in self.failed:
                return other
        return (self.rank + step) % self.size  # every other rank failed: nothing left to watch

    def beat_from(self, sender: int, now: float) -> None:
        if sender == self.predecessor:
            self.last_seen = now

    def bye_from(self, sender: int) -> None:
        if sender == self.predecessor:
            self.finished = True

    def silent(self, now: float) -> float | None:
        """Seconds the predecessor has been silent, if that is past the timeout and it is not known yet."""
        if self.finished or self.predecessor in self.failed:
            return None
        quiet = now - self.last_seen
        return quiet if quiet > self.timeout else None

    def record(self, rank: int, why: str, now: float) -> bool:
        """Note at ``now`` that ``rank`` failed; True if this is news. When it was the predecessor, the
        watch moves to the live rank before it, which beats here from now on (its silence counts from
        ``now``): survivors of a loss keep watching each other."""
        if rank in self.failed or rank == self.rank:
            return False
        watched = self.predecessor
        self.failed[rank] = why
        if rank == watched:
            self.last_seen = now
        return True


def silence_text(rank: int, silent_s: float, timeout: float) -> str:
    """Why ``rank`` is declared failed (``silent_s`` 0: its connection closed)."""
    if silent_s <= 0:
        return f"rank {rank} closed its connection (did it die?)"
    return (f"rank {rank} stopped responding: no heartbeat for {silent_s:.1f} s (limit {timeout:g} s, "
            "POPMESH_HEARTBEAT_TIMEOUT); it is frozen (SIGSTOP, a debugger, a hung host) or dead")


def start_heartbeat(p2p: Any, on_failure: Callable[[int, PeerFailure], None],
                    known: dict[int, PeerFailure] | None = None) -> Heartbeat | None:
    """A running heartbeat over ``p2p``, or None in a world of one or when turned off. ``known``: ranks
    already found failed (survivors going on without them): never watched, and reported as failed."""
    timeout = heartbeat_timeout()
    if p2p.size < 2 or timeout == 0:
        return None
    heartbeat = Heartbeat(p2p, timeout, on_failure, known)
    heartbeat.start()
    return heartbeat


class Heartbeat:
    """The heartbeat thread of one rank over ``p2p`` (see the module docstring).

    ``on_failure(rank, error)`` runs on the heartbeat thread when a rank is found failed, by this
    rank or by another's notice; the engine ends its waits on that rank there.
    """

    def __init__(self, p2p: Any, timeout: float, on_failure: Callable[[int, PeerFailure], None],
                 known: dict[int, PeerFailure] | None = None) -> None:
        self.p2p, self.timeout, self.interval = p2p, timeout, beat_interval(timeout)
        self.watch = RingWatch(p2p.rank, p2p.size, timeout, time.monotonic())
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: dict[int, PeerFailure] = dict(known or {})
        self._told = False  # told that a rank fails: this one goes down with it
        self.watch.failed.update({rank: str(error) for rank, error in self._errors.items()})
        self._thread = threading.Thread(target=self._run, name="popmesh-heartbeat", daemon=True)
        self._unregister: Callable[[], None] | None = None

    @property
    def rank(self) -> int:
        """This rank."""
        return self.watch.rank

    def start(self) -> None:
        self._thread.start()
        self._unregister = failing.register(self)  # an uncaught exception here is announced to the peers

    def announce_failing(self, text: str) -> None:
        """Tell every peer not known failed that this rank fails (an uncaught exception, ``text``): each
        is taken down with it. Waits up to :data:`ANNOUNCE_S` for the notes to leave."""
        note = failing_note(self.watch.rank, text)
        sent = [self._send(other, note) for other in range(self.p2p.size)
                if other != self.watch.rank and other not in self.watch.failed]
        deadline = time.monotonic() + ANNOUNCE_S
        for handle in sent:
            try:
                if handle is not None:
                    handle.wait(max(0.0, deadline - time.monotonic()))
            except (PopmeshError, ConfigError, RuntimeError):
                pass  # that peer is gone or slow: the others still hear

    def failure(self, ranks: Any = None) -> PeerFailure | None:
        """The failure of one of ``ranks`` (None: any rank) found so far, or None."""
        with self._lock:
            for rank, error in self._errors.items():
                if ranks is None or rank in ranks:
                    return error
        return None

    def failed_ranks(self) -> frozenset[int]:
        """Every rank found failed so far (by this rank or by another's notice)."""
        with self._lock:
            return frozenset(self._errors)

    def errors(self) -> dict[int, PeerFailure]:
        """Every rank found failed so far, with the PeerFailure that names it."""
        with self._lock:
            return dict(self._errors)

    def stop(self) -> None:
        """Say bye to the successor and end the thread (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._unregister is not None:
            self._unregister()
        if self._thread.ident is not None:
            self._thread.join(max(1.0, 3 * self.interval))
        self._send(self.watch.successor, encode_note(BYE, self.watch.rank))

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        watch = self.watch
        inbox: Any = self.p2p.irecv(None, HEARTBEAT_TAG)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send(watch.successor, encode_note(BEAT, watch.rank))
                next_beat = now + self.interval
            inbox = self._take(inbox)
            self._check_predecessor()
            if inbox is None and (watch.finished or watch.predecessor in watch.failed):
                return  # nothing can arrive and nothing is left to watch
            self._stop.wait(max(0.0, min(self.interval / 2, next_beat - time.monotonic())))

    def _check_predecessor(self) -> None:
        if self._told:
            # This rank goes down with the failing rank it was told of. Its engine closed the connection
            # to that rank while it still ran, which on gloo closes every connection of the group: a
            # closed connection or a silence from now on says nothing of another failure.
            return
        watch = self.watch
        gone = self.p2p.gone(watch.predecessor)
        if isinstance(gone, PeerClosed):
            watch.finished = True  # it closed in order: its bye may have been its last message
        elif gone is not None and watch.predecessor not in watch.failed:
            self._found(watch.predecessor, f"{silence_text(watch.predecessor, 0.0, self.timeout)}: {gone}", 0.0)
        if self.p2p.holding_back():
            # this rank holds its cap of unreceived messages and takes no more frames, beats included,
            # until the program receives: its predecessor is not silent, this rank is not listening
            watch.beat_from(watch.predecessor, time.monotonic())
        silent = watch.silent(time.monotonic())
        if silent is not None:
            self._found(watch.predecessor, silence_text(watch.predecessor, silent, self.timeout), silent)

    def _take(self, inbox: Any) -> Any:
        """Handle every note that arrived; the receive to keep polling (None: nothing more can arrive)."""
        while inbox is not None:
            try:
                if not inbox.done():
                    return inbox
                _, frame = inbox.wait(0)
            except PeerFailure:  # every rank it could hear from has gone
                return None
            inbox = self.p2p.irecv(None, HEARTBEAT_TAG)
            try:
                kind, sender, about, silent = decode_note(frame)
            except ConfigError:
                continue
            if kind == BEAT:
                self.watch.beat_from(sender, time.monotonic())
            elif kind == BYE:
                self.watch.bye_from(sender)
            elif kind == FAILING:
                self._failing(sender, note_text(frame))
            elif about != self.watch.rank:
                self._failed(about, f"{silence_text(about, silent, self.timeout)} (found by rank {sender})")
        return None

    def _failing(self, rank: int, text: str) -> None:
        """``rank`` fails with ``text``: its waits end now, and this process is taken down with it."""
        self._told = True
        self._failed(rank, f"rank {rank} failed: {text} (an uncaught exception)")
        failing.take_down(self.watch.rank, rank, text, min(self.timeout, TAKE_DOWN_S))

    def _found(self, rank: int, why: str, silent: float) -> None:
        """This rank found ``rank`` failed: tell every other rank, then act on it."""
        if rank in self.watch.failed:
            return
        for other in range(self.p2p.size):
            if other not in (self.watch.rank, rank) and other not in self.watch.failed:
                self._send(other, encode_note(NOTICE, self.watch.rank, rank, silent))
        self._failed(rank, why)

    def _failed(self, rank: int, why: str) -> None:
        if not self.watch.record(rank, why, time.monotonic()):
            return
        error = PeerFailure(why, (rank,))
        with self._lock:
            self._errors[rank] = error
        self._on_failure(rank, error)

    def _send(self, dst: int, note: np.ndarray) -> Any:
        try:
            return self.p2p.isend(note, dst, HEARTBEAT_TAG)
        except (PopmeshError, ConfigError, RuntimeError):
            return None  # a rank that left or failed gets no more notes; its loss is found on its own
