"""Watching the MPI ranks on this host, which mpiexec started, so a rank killed by a signal can be named.

mpiexec reports only its own exit status, and Hydra's "BAD TERMINATION" banner names the first of the
processes its cleanup killed, not the first to die. So each rank's bootstrap leaves a pid note when it
starts and an exit note when it exits normally (:mod:`popmesh.launch.bootstrap`); a thread of the
launcher adopts every pid note of this host as it appears, opens a pidfd for it and answers with a
``.watched`` note, which the rank waits for (up to a second) before it runs the user's code; so every
process's end is seen through its pidfd, in order, even on a loaded machine. A rank whose process
ended without an exit note (and without an error record, which the judge checks) was killed; the
first such rank is the root cause (ranks seen to end in the same wake-up cannot be told apart: the
judge says so). Ranks on other hosts are seen only through their error records.
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import threading
import time
from dataclasses import dataclass

from popmesh.launch.bootstrap import EXIT_NOTE, PID_NOTE, WATCHED_NOTE
from popmesh.launch.plan import error_file_name

__all__ = ["RankEnd", "RankWatch"]

_TICK_S = 0.02


@dataclass(frozen=True)
class RankEnd:
    """A rank's process that ended without an exit note: when it was seen to end (wall clock), where."""

    rank: int
    pid: int
    host: str
    time: float


class RankWatch:
    """A context manager: from enter to exit, watches the ranks of this host that leave pid notes in ``error_dir``."""

    def __init__(self, error_dir: str, host: str | None = None) -> None:
        self._dir = error_dir
        self._host = host or os.uname().nodename
        self._pidfds: dict[int, tuple[int, int, str]] = {}  # pidfd -> (rank, pid, host)
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
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds.clear()

    def killed(self) -> list[RankEnd]:
        """The ranks of this host whose process ended without an exit note, earliest first (after exit)."""
        noted = {end.rank for end in self._ended if os.path.exists(self._note(end.rank, EXIT_NOTE))}
        return sorted((end for end in self._ended if end.rank not in noted), key=lambda end: (end.time, end.rank))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._adopt()
            self._collect(_TICK_S)

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
            if host == self._host:
                try:
                    self._pidfds[os.pidfd_open(pid)] = (rank, pid, host)
                except ProcessLookupError:  # already gone (it gave up waiting for the answer)
                    self._gone.append((rank, pid, host))
                except OSError:  # no pidfds here: this rank is not watched
                    pass
            with contextlib.suppress(OSError):  # the rank goes on (a rank of another host: unwatched)
                open(self._note(rank, WATCHED_NOTE), "w").close()

    def _collect(self, wait: float) -> None:
        """Record the watched processes that ended, waiting up to ``wait`` seconds for one. Ranks found
        already gone when adopted ended at some moment since the last wake-up, as did the ones seen now:
        they share this wake-up's time, so the judge says their order cannot be told (stamping each at
        its adoption ordered them by file name, and named a rank Hydra killed as the root cause)."""
        if not self._pidfds and not self._gone:
            if wait:
                self._stop.wait(wait)
            return
        ready, _, _ = select.select(list(self._pidfds), [], [], 0.0 if self._gone else wait)
        now = time.time()
        for rank, pid, host in self._gone:
            self._ended.append(RankEnd(rank, pid, host, now))
        self._gone.clear()
        for fd in ready:
            rank, pid, host = self._pidfds.pop(fd)
            os.close(fd)
            self._ended.append(RankEnd(rank, pid, host, now))
