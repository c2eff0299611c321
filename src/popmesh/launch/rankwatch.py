"""Watching the MPI ranks on this host, which mpiexec started, so a rank killed by a signal can be named.

mpiexec reports only its own exit status, and Hydra's "BAD TERMINATION" banner names the first of the
processes its cleanup killed, not the first to die. So each rank's bootstrap leaves a pid note when it
starts and an exit note when it exits normally (:mod:`popmesh.launch.bootstrap`); a thread of the
launcher adopts every pid note of this host as it appears, opens a pidfd for it and answers with a
``.watched`` note, which the rank waits for before it runs the user's code; so every process's end is
seen through its pidfd, even on a loaded machine. A rank whose process ended without an exit note
(and without an error record, which the judge checks) was killed; the first such rank is the root cause.

Which rank died first is told exactly by an *end pipe*: a FIFO per rank whose only writer the rank
holds, at a descriptor number above Hydra's PMI socket. A dying process's files are released highest
number first (checked on this kernel once: :func:`releases_highest_first`), so the rank's end pipe
reports its end before Hydra can see the PMI socket close, which is what makes Hydra kill the other
ranks; and the launcher reads the pipes' ends in the order the kernel made them ready (epoll's ready
list). Ranks without an end pipe (a kernel that releases lowest first, a rank whose forked child still
holds the pipe, a rank found already gone) are ordered by when their pidfd was seen to be ready, and
ranks seen in the same wake-up cannot be told apart: the judge says so. Ranks on other hosts are seen
only through their error records and exit notes (where the launcher's folder is shared with them).

The watch also ends the job where Hydra would not. Hydra tears the job down when a rank is killed by a
signal or when a rank that initialised MPI dies or aborts (the bootstrap aborts the job when such a rank
fails), but not when a rank exits with a non-zero code before it initialised MPI (an import error, an
argument error, a missing file) or in a script that never uses MPI: the other ranks would run on until
they end by themselves, or wait in ``MPI_Init`` forever. Such a rank leaves an exit note with its status;
the watch reads every exit note as it appears and, as :func:`ends_the_job` decides, tells the launcher
(``on_failure``), which tears the job down.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import select
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from popmesh.launch.bootstrap import END_PIPE, EXIT_NOTE, HELD_NOTE, PID_NOTE, WATCHED_NOTE
from popmesh.launch.plan import error_file_name

__all__ = ["RankEnd", "RankExit", "RankWatch", "earliest_first", "ends_the_job", "read_exit_note",
           "releases_highest_first"]

_TICK_S = 0.02
_ARM_TICK_S = 0.002  # the tick while a rank waits to be told it is watched
_HOLD_WAIT_S = 3.0  # how long a rank may take to hold its end pipe before it is watched without one
_HUP = select.EPOLLHUP | select.EPOLLERR


@dataclass(frozen=True)
class RankEnd:
    """A rank's process that ended without an exit note: when it was seen to end (wall clock), where;
    ``order``: its place among this host's ranks' ends as the kernel made them (from its end pipe;
    None where it had none)."""

    rank: int
    pid: int
    host: str
    time: float
    order: int | None = None


@dataclass(frozen=True)
class RankExit:
    """A rank's exit note: the status its bootstrap exited with, when (wall clock) and where (its pid
    note's host; empty where it left none)."""

    rank: int
    status: int
    time: float
    host: str = ""


def read_exit_note(path: str, rank: int, host: str = "") -> RankExit | None:
    """The exit note at ``path`` (``STATUS TIME``; a note of only ``STATUS`` is timed by the file), or None
    where there is none or it cannot be read."""
    try:
        with open(path) as f:
            fields = f.read().split()
        status = int(fields[0])
        when = float(fields[1]) if len(fields) > 1 else os.stat(path).st_mtime
    except (OSError, ValueError, IndexError):
        return None
    return RankExit(rank, status, when, host)


def ends_the_job(exits: Iterable[RankExit]) -> RankExit | None:
    """The exit that calls for the launcher to end the MPI job, or None while none does. Pure.

    A rank that exited with a non-zero status through its bootstrap does. Hydra ends the job for a rank
    that fails while it runs MPI (its bootstrap aborts the job, and may be killed before it leaves
    the note), but not for one that failed before MPI started, after it finalised MPI, or in a script that
    does not use MPI; a note does not tell these apart, and ending a job Hydra is ending already is
    harmless. Of several such exits, the earliest (then the lowest rank) is the one named. A zero status
    does not, nor an end without an exit note: a signal or an MPI abort, which Hydra acts on itself, or
    ``os._exit``, whose status nobody but its parent (Hydra's proxy) learns (``os._exit(0)`` is a success).
    """
    return min((e for e in exits if e.status != 0), key=lambda e: (e.time, e.rank), default=None)


@functools.cache
def releases_highest_first() -> bool:
    """Whether this kernel releases a dying process's files highest descriptor number first (Linux runs
    the deferred closes of an exiting task last queued, first run): a throwaway shell holds two FIFOs as
    descriptors 3 and 9 and kills itself; the order in which their readers see the end tells (the
    readers are watched only once the shell holds both: an open also readies a reader). ~3 ms, once."""
    try:
        with tempfile.TemporaryDirectory(prefix="popmesh-order-") as tmp:
            low, high = os.path.join(tmp, "low"), os.path.join(tmp, "high")
            os.mkfifo(low)
            os.mkfifo(high)
            readers = [os.open(path, os.O_RDONLY | os.O_NONBLOCK) for path in (low, high)]
            poll = select.epoll()
            shell = f'exec 3>"{low}" 9>"{high}"; echo held; read go; kill -9 $$'
            try:
                with subprocess.Popen(["/bin/sh", "-c", shell], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
                    assert proc.stdin is not None and proc.stdout is not None
                    held = proc.stdout.readline() == b"held\n"
                    for fd in readers:
                        poll.register(fd, _HUP)
                    proc.stdin.write(b"go\n")
                    proc.stdin.close()
                    proc.wait(10)
                events = poll.poll(1.0)
            finally:
                poll.close()
                for fd in readers:
                    os.close(fd)
    except (OSError, subprocess.SubprocessError):
        return False
    return held and len(events) == 2 and events[0][0] == readers[1]


def earliest_first(ends: list[RankEnd]) -> list[RankEnd]:
    """``ends`` in the kernel's order where each has its place in it (:attr:`RankEnd.order`), else by
    when each was seen (then by rank). Pure."""
    if all(end.order is not None for end in ends):
        return sorted(ends, key=lambda end: end.order or 0)
    return sorted(ends, key=lambda end: (end.time, end.rank))


class RankWatch:
    """A context manager: from enter to exit, watches the ranks of this host that leave pid notes in ``error_dir``."""

    def __init__(
        self, error_dir: str, host: str | None = None, on_failure: Callable[[RankExit], None] | None = None
    ) -> None:
        self._dir = error_dir
        self._host = host or os.uname().nodename
        self._on_failure = on_failure  # called once, from the watch's thread, when ends_the_job names an exit
        self._told = False
        self._hosts: dict[int, str] = {}  # rank -> the host its pid note names
        self._exits: dict[int, RankExit] = {}
        self._pidfds: dict[int, tuple[int, int, str]] = {}  # pidfd -> (rank, pid, host)
        self._pipes: dict[int, int] = {}  # end pipe's read end -> rank, once the rank holds the writer
        self._unheld: dict[int, tuple[int, float]] = {}  # rank -> (its end pipe's read end, adopted when)
        self._orders: dict[int, int] = {}  # rank -> its place among the ends its end pipe showed
        self._epoll = select.epoll()
        self._exact = releases_highest_first()
        self._adopted: set[str] = set()
        self._ended: list[RankEnd] = []
        self._gone: list[tuple[int, int, str]] = []  # adopted already ended: when is unknown (see _collect)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="popmesh-rank-watch", daemon=True)

    def __enter__(self) -> RankWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._adopt()  # a note written just before the end
        self._collect(0.0)
        self._read_exits()
        for fd in [*self._pidfds, *self._pipes, *(fd for fd, _ in self._unheld.values())]:
            os.close(fd)
        self._pidfds.clear()
        self._pipes.clear()
        self._unheld.clear()
        self._epoll.close()

    def killed(self) -> list[RankEnd]:
        """The ranks of this host whose process ended without an exit note, earliest first (after exit)."""
        noted = {end.rank for end in self._ended if os.path.exists(self._note(end.rank, EXIT_NOTE))}
        return earliest_first([end for end in self._ended if end.rank not in noted])

    def exits(self) -> list[RankExit]:
        """The exit notes of every rank that left one in the folder (any host), by rank (after exit)."""
        return [self._exits[rank] for rank in sorted(self._exits)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._adopt()
            self._arm()
            self._collect(_TICK_S)
            self._read_exits()
            self._tell()

    def _read_exits(self) -> None:
        """Read the exit notes that appeared since the last look (a note is written whole, once)."""
        for path in glob.glob(self._note("*", EXIT_NOTE)):
            rank = int(os.path.basename(path)[len("rank-"):-len(EXIT_NOTE)])
            if rank not in self._exits:
                found = read_exit_note(path, rank, self._hosts.get(rank, ""))
                if found is not None:
                    self._exits[rank] = found

    def _tell(self) -> None:
        if self._told or self._on_failure is None:
            return
        cause = ends_the_job(self._exits.values())
        if cause is not None:
            self._told = True
            self._on_failure(cause)

    def _note(self, rank: int | str, suffix: str) -> str:
        return os.path.join(self._dir, os.path.splitext(error_file_name(rank))[0] + suffix)

    def _adopt(self) -> None:
        for path in glob.glob(self._note("*", PID_NOTE)):
            if path in self._adopted:
                continue
            self._adopted.add(path)
            rank = int(os.path.basename(path)[len("rank-"):-len(PID_NOTE)])
            try:
                with open(path) as f:
                    pid_text, host = f.read().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                continue
            self._hosts[rank] = host
            piped = False
            if host == self._host:
                try:
                    pidfd = os.pidfd_open(pid)
                except ProcessLookupError:  # already gone (it gave up waiting for the answer)
                    self._gone.append((rank, pid, host))
                except OSError:  # no pidfds here: this rank is not watched
                    pass
                else:
                    self._pidfds[pidfd] = (rank, pid, host)
                    self._epoll.register(pidfd, select.EPOLLIN)
                    piped = self._exact and self._open_end_pipe(rank)
            if not piped:
                self._say_watched(rank)

    def _say_watched(self, rank: int) -> None:
        with contextlib.suppress(OSError):  # the rank goes on (a rank of another host: unwatched)
            open(self._note(rank, WATCHED_NOTE), "w").close()

    def _arm(self) -> None:
        """Read the end pipes whose rank now holds the writer, and tell those ranks they are watched.
        Only now: opening a FIFO readies its reader, and a reader already in epoll's ready list keeps
        its place there, so a pipe read before its writer opened could be ordered by its open."""
        now = time.monotonic()
        for rank, (fd, adopted) in list(self._unheld.items()):
            if os.path.exists(self._note(rank, HELD_NOTE)):
                self._pipes[fd] = rank
                self._epoll.register(fd, _HUP | select.EPOLLIN)  # data: the rank could not place its writer
            elif now - adopted < _HOLD_WAIT_S:
                continue
            else:
                os.close(fd)  # the rank did not hold it (no end pipes in its bootstrap): pidfd order
            del self._unheld[rank]
            self._say_watched(rank)

    def _open_end_pipe(self, rank: int) -> bool:
        """Make ``rank``'s end pipe and open its read end (read once the rank holds the writer: :meth:`_arm`)."""
        path = self._note(rank, END_PIPE)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            os.mkfifo(path)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:  # no FIFOs in this folder: the pidfd order stays
            return False
        self._unheld[rank] = (fd, time.monotonic())
        return True

    def _collect(self, wait: float) -> None:
        """Record the watched processes that ended, waiting up to ``wait`` seconds for one. Ranks found
        already gone when adopted ended at some moment since the last wake-up, as did the ones seen now:
        they share this wake-up's time, so the judge says their order cannot be told (stamping each at
        its adoption ordered them by file name, and named a rank Hydra killed as the root cause), unless
        their end pipes ordered them: epoll returns ready descriptors in the order they became ready."""
        if not self._pidfds and not self._pipes and not self._gone and not self._unheld:
            if wait:
                self._stop.wait(wait)
            return
        events = self._epoll.poll(0.0 if self._gone else min(wait, _ARM_TICK_S) if self._unheld else wait)
        now = time.time()
        for rank, pid, host in self._gone:
            self._ended.append(RankEnd(rank, pid, host, now))
        self._gone.clear()
        for fd, flags in events:
            if fd in self._pipes:
                rank = self._pipes.pop(fd)
                if not flags & select.EPOLLIN:  # data in it: the rank could not place its writer
                    self._orders[rank] = len(self._orders)  # read when its pidfd ends: later, it orders nothing
            elif fd in self._pidfds:
                rank, pid, host = self._pidfds.pop(fd)
                self._ended.append(RankEnd(rank, pid, host, now, self._orders.get(rank)))
            else:
                continue
            self._epoll.unregister(fd)
            os.close(fd)
