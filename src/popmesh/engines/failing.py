"""A rank that fails takes its world down, whatever launched the job.

Launchers end a job when one of its processes fails, but only once that process has *exited*, and
an exit can wait forever: ``MPI_Finalize`` waits for the other ranks, and a peer blocked in a wait
on the failed rank never gets there (mpiexec then has nothing to act on). So once popmesh has formed
a world of two or more ranks, an uncaught exception in the main thread runs this module's
``sys.excepthook`` after Python has printed the traceback. It

* tells every peer that this rank is failing (the heartbeat's *failing* note,
  :mod:`popmesh.engines.liveness`);
* names the ranks this rank knows had failed, when there are any (the error is then most likely a
  consequence of theirs, such as gloo's "Connection closed by peer");
* ends the process if its exit stalls (:data:`EXIT_WATCHDOG_S`);
* aborts MPI where MPI is up (``MPI_Abort``: the MPI launcher then ends every rank), whoever
  initialised it, popmesh's MPI engine or the program's own ``import mpi4py.MPI``.

A peer told that a rank is failing closes its connections to it (a wait on that rank, in popmesh or
in gloo, fails at once) and calls :func:`take_down`: unless the peer ends by itself within the grace
time, it ends there, saying which rank failed, why, and where its main thread was. That is a wait
popmesh cannot interrupt from outside (an any-source ``torch.distributed.recv``, which gloo offers no
way to cancel), work that never reaches popmesh again, or an exit that waits for the failed rank.

Under ``popmesh launch`` each rank's bootstrap handles an uncaught exception itself (the launcher
takes the world down, or restarts the rank), so this hook does not run there.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from popmesh.core.errors import PeerFailure

__all__ = ["Announcer", "EXIT_WATCHDOG_S", "install", "register", "take_down", "describe"]

EXIT_WATCHDOG_S = 5.0  # after this process's own failure, how long its exit may take
BACKSTOP_S = 5.0  # past a deadline, when a call that holds the interpreter lock keeps the timer from running
SETTLE_S = 0.6  # a heartbeat takes in its notes every half beat, at most 0.5 s
_LOSS_WORDS = ("connection closed", "closed by peer", "connection reset", "broken pipe", "pair closure")
_STACK_FRAMES = 8  # of the main thread, where a taken-down rank was
_TEXT_CHARS = 400

_lock = threading.Lock()
_announcers: list[Announcer] = []
_previous: Callable[[type[BaseException], BaseException, TracebackType | None], object] | None = None
_failing = threading.Event()  # this process handles its own uncaught exception: it is exiting
_taken_down = threading.Event()  # a peer's failure takes this process down (once)


class Announcer(Protocol):
    """What tells a world's peers that this rank fails (a running heartbeat)."""

    @property
    def rank(self) -> int: ...
    def announce_failing(self, text: str) -> None: ...
    def errors(self) -> dict[int, PeerFailure]: ...


def install() -> None:
    """Chain this module's hook to ``sys.excepthook`` (once per process; the hook before it still
    prints the traceback first)."""
    global _previous
    with _lock:
        if _previous is None:
            _previous = sys.excepthook
            sys.excepthook = _hook


def register(announcer: Announcer) -> Callable[[], None]:
    """Announce this rank's failure through ``announcer`` from now on; returns what stops it."""
    install()
    with _lock:
        _announcers.append(announcer)

    def unregister() -> None:
        with _lock:
            if announcer in _announcers:
                _announcers.remove(announcer)

    return unregister


def describe(error: BaseException) -> str:
    """``Type: first line of the message``, short enough for a heartbeat note."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= _TEXT_CHARS else line[:_TEXT_CHARS - 1] + "…"


def _hook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    (_previous or sys.__excepthook__)(etype, value, tb)
    _failing.set()
    with _lock:
        announcers = list(_announcers)
    mpi_up = _mpi_up()
    # Before the peers are told: a peer told that this rank fails closes its connection to it, which
    # would read here as that peer lost too.
    known = _known_failures(announcers, settle=_lost_a_peer(value))
    if announcers or mpi_up:
        who = f"rank {announcers[0].rank}" if announcers else "this rank"
        steps = (["its peers are told"] if announcers else []) + (["MPI is aborted"] if mpi_up else [])
        _write(f"popmesh: {who} failed ({describe(value)}), and its world goes down with it: {', '.join(steps)}\n")
    for announcer in announcers:
        try:
            announcer.announce_failing(describe(value))
        except Exception:
            pass  # the peers still find this rank gone through their heartbeats
    if known:
        _write(f"popmesh: before this error, rank(s) {sorted(known)} of this world had failed: "
               + "; ".join(str(known[r]) for r in sorted(known)) + "\n")
    _arm(EXIT_WATCHDOG_S, _exit_stalled, announcers[0].rank if announcers else None)
    if mpi_up:
        from popmesh.engines.mpi.beside import abort_running

        abort_running(1)


def _mpi_up() -> bool:
    """Whether this process initialised MPI and has not finalised it (never imports MPI)."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and bool(MPI.Is_initialized()) and not MPI.Is_finalized()


def _lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` says a connection to a peer was lost (a transport's words, gloo's among them)."""
    return isinstance(error, PeerFailure) or any(w in str(error).lower() for w in _LOSS_WORDS)


def _known_failures(announcers: list[Announcer], settle: bool) -> dict[int, PeerFailure]:
    """The peers known failed; with ``settle``, waiting up to :data:`SETTLE_S` for news (an error that a
    peer's failure caused, gloo's closed connection, can come before that peer's note is taken in).
    A rank that fails by itself does not wait: launchers name the first rank to exit as the cause."""
    deadline = time.monotonic() + (SETTLE_S if announcers and settle else 0.0)
    while True:
        known: dict[int, PeerFailure] = {}
        for announcer in announcers:
            known.update(announcer.errors())
        if known or time.monotonic() >= deadline:
            return known
        time.sleep(0.02)


def take_down(me: int, failed: int, why: str, grace: float) -> None:
    """Rank ``failed`` of this world is failing (``why``): end this process, rank ``me``, unless it ends by
    itself within ``grace`` seconds. Called by the heartbeat thread; the first call counts."""
    if _taken_down.is_set():
        return
    _taken_down.set()
    _arm(grace, _end, me, failed, why, grace)


def _arm(seconds: float, action: Callable[..., None], *args: object) -> None:
    """Run ``action(*args)`` in ``seconds`` on a daemon timer, and end the process from C a little later
    if the timer cannot run (a blocked call holding the interpreter lock)."""
    timer = threading.Timer(seconds, action, args=args)
    timer.daemon = True
    timer.name = "popmesh-take-down"
    timer.start()
    try:
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
    except (ValueError, OSError, RuntimeError):
        pass  # no usable stderr: the timer alone


def _end(me: int, failed: int, why: str, grace: float) -> None:
    if _failing.is_set():
        return  # this rank fails by itself: its own exit watchdog ends it
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident or -1) if main.is_alive() else None
    if frame is not None:
        stack = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:])
        where = ("its main thread was here, in a wait that popmesh cannot interrupt (an any-source "
                 f"torch.distributed.recv, for one) or in work that does not reach popmesh again:\n{stack}")
    else:
        where = "its main thread had ended, and its exit waited (for the failed rank, in MPI_Finalize or a send)\n"
    _write(f"popmesh: rank {failed} failed ({why}), and a rank that fails takes its world down; rank {me} was still "
           f"running {grace:g} s later: {where}popmesh: ending rank {me} (exit status 1)\n")
    os._exit(1)


def _exit_stalled(me: int | None) -> None:
    who = "this rank" if me is None else f"rank {me}"
    _write(f"popmesh: {who}'s exit stalled {EXIT_WATCHDOG_S:g} s after its uncaught exception (an atexit hook or "
           "a non-daemon thread waits); ending it (exit status 1)\n")
    os._exit(1)


def _write(text: str) -> None:
    """To stderr at once, also when Python's own streams are gone (a process being finalized)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        try:
            os.write(2, text.encode(errors="replace"))
        except OSError:
            pass
