"""Copy the ranks' output to the launcher's streams, one prefixed line at a time.

One reader thread per child pipe reads whole lines and writes ``[rank r] line`` to the launcher's
stdout or stderr (kept apart), flushing after each line so output appears as it is produced.
Every rank's last lines are also kept in memory: when a rank fails, its stderr tail goes into
the root-cause summary even if ``quiet_others`` hid it from the terminal. An optional sink (the
per-rank log files of ``--log-dir``/``--tee``/``--redirects``) gets each rank's lines as written, and
decides which of them the console shows.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from typing import IO, Protocol, TextIO

__all__ = ["OutputPump", "OutputSink", "PREFIX", "say"]

PREFIX = "[rank {rank}] "
_PREFIXED = re.compile(rb"^\[rank (\d+)\] ")
TAIL_LINES = 200


class OutputSink(Protocol):
    """Where ranks' lines go besides the console (:class:`popmesh.launch.logs.RankLogs`)."""

    def shows(self, rank: int, stream: str) -> bool:
        """Whether the console shows ``rank``'s ``stream``."""
        ...

    def write(self, rank: int, stream: str, data: bytes) -> None:
        """Keep one line of ``rank``'s ``stream``, exactly as the rank wrote it (without prefix)."""
        ...


class OutputPump:
    """Reader threads for child pipes, writing to ``stdout``/``stderr`` under one lock.

    ``quiet_others`` shows only rank 0 (and lines of no rank, e.g. mpiexec's own messages); ``sink``
    gets every rank's lines and may hide some from the console.
    """

    def __init__(
        self, stdout: TextIO, stderr: TextIO, *, quiet_others: bool = False, sink: OutputSink | None = None
    ) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._quiet_others = quiet_others
        self._sink = sink
        self._lock = threading.Lock()
        self._tails: dict[tuple[int | None, str], deque[str]] = {}
        self._threads: list[threading.Thread] = []
        self._broken: set[str] = set()

    def attach(self, pipe: IO[bytes], name: str, rank: int | None) -> None:
        """Start copying ``pipe`` to stream ``name`` ("stdout" or "stderr").

        With ``rank=None`` the lines are expected to carry their own ``[rank r] `` prefix
        (mpiexec's ``-prepend-pattern``); lines without one are the launcher's own.
        """
        thread = threading.Thread(
            target=self._pump, args=(pipe, name, rank), name=f"popmesh-{name}-{rank}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _pump(self, pipe: IO[bytes], name: str, rank: int | None) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                self._emit(raw, name, rank)
        except (OSError, ValueError):  # pipe closed under us during teardown
            pass
        finally:
            pipe.close()

    def _emit(self, raw: bytes, name: str, rank: int | None) -> None:
        if rank is None:
            match = _PREFIXED.match(raw)
            line_rank = int(match.group(1)) if match else None
            body = raw[match.end():] if match else raw
        else:
            line_rank, body = rank, raw
        text = body.decode("utf-8", errors="replace").rstrip("\n")
        prefix = "" if line_rank is None else PREFIX.format(rank=line_rank)
        with self._lock:
            self._tails.setdefault((line_rank, name), deque(maxlen=TAIL_LINES)).append(text)
            if line_rank is not None and self._sink is not None:
                self._sink.write(line_rank, name, body)
            if not self._shown(line_rank, name) or name in self._broken:
                return
            try:
                self._streams[name].write(f"{prefix}{text}\n")
                self._streams[name].flush()
            except (OSError, ValueError):  # e.g. `popmesh launch ... | head`: keep draining, stop writing
                self._broken.add(name)

    def _shown(self, rank: int | None, name: str) -> bool:
        """True if the console shows ``rank``'s ``name`` stream (lines of no rank always)."""
        if rank is None:
            return True
        if self._sink is not None and not self._sink.shows(rank, name):
            return False
        return not (self._quiet_others and rank != 0)

    def tail(self, rank: int | None, name: str = "stderr", lines: int = 20) -> list[str]:
        """The last ``lines`` lines rank ``rank`` wrote to ``name`` (kept even when not shown)."""
        with self._lock:
            kept = list(self._tails.get((rank, name), ()))
        return kept[-lines:]

    def join(self, timeout: float = 2.0) -> None:
        """Wait (bounded) for the readers to drain their pipes after the children exited."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def say(err: TextIO, line: str | None) -> None:
    """Write one message of the launcher's own (if any) to ``err`` at once."""
    if line:
        err.write(line + "\n")
        err.flush()
