"""Turning the trace timeline on and off for a World: clocks aligned to rank 0, the engine wrapped.

:func:`start` (``World.start_trace``) agrees on a clock with the other ranks (collective), then wraps
the World's engine in :class:`TracedEngine`, which records a span per collective, send and receive
(peer, tag, bytes) and hands every call on unchanged. :func:`stop` (``World.stop_trace``,
``World.finalize``) unwraps the engine and writes this rank's file; the last rank to write (and rank
0, after waiting a little for the others) merges the files into ``DIR/trace.json`` unless the
launcher said it will (``popmesh launch --trace``). While tracing is off the World holds the engine
itself: no call on any communication path goes through this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from popmesh.core import trace
from popmesh.core.errors import ConfigError
from popmesh.wire.format import HEADER_NBYTES

__all__ = ["start", "stop", "TracedEngine", "clock_offsets", "ALIGN_ROUNDS", "MERGE_WAIT_S",
           "LAUNCHER_MERGES_ENV"]

ALIGN_ROUNDS = 7  # barrier-then-stamp rounds; the median of the per-round differences is the offset
MERGE_WAIT_S = 10.0  # how long rank 0 waits for the other ranks' files before merging what is there
LAUNCHER_MERGES_ENV = "POPMESH_TRACE_MERGED_BY"  # set by `popmesh launch --trace`: the ranks do not merge

_now = time.perf_counter_ns


def _nbytes(x: Any) -> int:
    """Bytes of an array, tensor, bytes-like object or a sequence of them (a message frame)."""
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(part) for part in x)
    n = getattr(x, "nbytes", None)
    return int(n) if n is not None else len(x)


def _plain_frame_nbytes(payload: Any) -> int:
    """The wire frame's bytes of bytes or a numpy array (what a span of the undecoded path records)."""
    return HEADER_NBYTES + 8 * getattr(payload, "ndim", 1) + _nbytes(payload)


class _TracedPending:
    """An engine's Pending whose completion (first ``wait`` that returns, or ``done()`` true) ends a span.

    ``receives``: the result is ``(source, data)``, whose source and size go into the span."""

    def __init__(self, inner: Any, recorder: trace.Recorder, name: str, args: dict[str, Any],
                 receives: bool = False) -> None:
        self._inner, self._recorder, self._name, self._args = inner, recorder, name, args
        self._receives = receives
        self._start: int | None = _now()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _end(self, received: Any = None) -> None:
        if self._start is None:
            return
        if isinstance(received, tuple) and len(received) == 2:
            self._args["src"], self._args["bytes"] = int(received[0]), _nbytes(received[1])
        self._recorder.add(self._name, "comm", self._start, _now(), self._args)
        self._start = None

    def done(self) -> bool:
        finished = bool(self._inner.done())
        if finished and self._start is not None:
            received = None
            if self._receives:
                with contextlib.suppress(Exception):  # a failed receive raises at wait(), as without tracing
                    received = self._inner.result()
            self._end(received)
        return finished

    def wait(self, timeout: float) -> Any:
        out = self._inner.wait(timeout)
        self._end(out if self._receives else None)
        return out


class _TracedP2P:
    """The engine's point-to-point object, with a span per send and receive."""

    def __init__(self, inner: Any, recorder: trace.Recorder) -> None:
        self.inner, self._recorder = inner, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, frame: Any, dst: int, tag: int, timeout: float) -> None:
        start = _now()
        try:
            self.inner.send(frame, dst, tag, timeout)
        finally:
            self._recorder.add("send", "comm", start, _now(), {"dst": dst, "tag": tag, "bytes": _nbytes(frame)})

    def recv(self, src: Any, tag: int, timeout: float) -> tuple[int, Any]:
        start = _now()
        args: dict[str, Any] = {"tag": tag}
        try:
            sender, data = self.inner.recv(src, tag, timeout)
            args["src"], args["bytes"] = sender, _nbytes(data)
            return sender, data
        finally:
            self._recorder.add("recv", "comm", start, _now(), args)

    def send_value(self, payload: Any, dst: int, tag: int, timeout: float, checksum: bool | None = None) -> bool:
        start = _now()
        sent = False
        try:
            sent = self.inner.send_value(payload, dst, tag, timeout, checksum)
            return sent
        finally:
            if sent:  # else the caller sends the encoded frame through send(), which records it
                self._recorder.add("send", "comm", start, _now(),
                                   {"dst": dst, "tag": tag, "bytes": _plain_frame_nbytes(payload)})

    def isend_value(self, payload: Any, dst: int, tag: int, checksum: bool | None = None) -> Any:
        pending = self.inner.isend_value(payload, dst, tag, checksum)
        if pending is None:  # the caller sends the encoded frame through isend(), which records it
            return None
        args = {"dst": dst, "tag": tag, "bytes": _plain_frame_nbytes(payload), "async": True}
        return _TracedPending(pending, self._recorder, "send", args)

    def recv_decoded(self, src: Any, tag: int, timeout: float) -> tuple[int, Any, bool]:
        start = _now()
        args: dict[str, Any] = {"tag": tag}
        try:
            sender, data, decoded = self.inner.recv_decoded(src, tag, timeout)
            args["src"], args["bytes"] = sender, _plain_frame_nbytes(data) if decoded else _nbytes(data)
            return sender, data, decoded
        finally:
            self._recorder.add("recv", "comm", start, _now(), args)

    def isend(self, frame: Any, dst: int, tag: int) -> Any:
        args = {"dst": dst, "tag": tag, "bytes": _nbytes(frame), "async": True}
        return _TracedPending(self.inner.isend(frame, dst, tag), self._recorder, "send", args)

    def irecv(self, src: Any, tag: int) -> Any:
        args = {"tag": tag, "async": True}
        return _TracedPending(self.inner.irecv(src, tag), self._recorder, "recv", args, receives=True)


class TracedEngine:
    """An engine that records a span per collective and point-to-point call, then hands the call on.

    Attributes and methods not traced (rank, size, tuning, make_group, ...) are the engine's own.
    """

    def __init__(self, engine: Any, recorder: trace.Recorder) -> None:
        self.inner, self._recorder = engine, recorder
        self._p2p: _TracedP2P | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, name: str, call: Callable[[], Any], nbytes: int | None) -> Any:
        start = _now()
        try:
            return call()
        finally:
            self._recorder.add(name, "comm", start, _now(), None if nbytes is None else {"bytes": nbytes})

    def all_reduce_(self, buf: Any, op: Any, group: Any, timeout: float) -> None:
        self._timed("all_reduce", lambda: self.inner.all_reduce_(buf, op, group, timeout), _nbytes(buf))

    def all_reduce_start(self, buf: Any, op: Any, group: Any) -> Any:
        pending = self.inner.all_reduce_start(buf, op, group)
        return _TracedPending(pending, self._recorder, "all_reduce", {"bytes": _nbytes(buf), "async": True})

    def all_gather(self, buf: Any, group: Any, timeout: float) -> Any:
        return self._timed("all_gather", lambda: self.inner.all_gather(buf, group, timeout), _nbytes(buf))

    def broadcast_(self, buf: Any, root: int, group: Any, timeout: float) -> None:
        self._timed("broadcast", lambda: self.inner.broadcast_(buf, root, group, timeout), _nbytes(buf))

    def gather(self, buf: Any, root: int, group: Any, timeout: float) -> Any:
        return self._timed("gather", lambda: self.inner.gather(buf, root, group, timeout), _nbytes(buf))

    def reduce_scatter(self, buf: Any, op: Any, group: Any, timeout: float) -> Any:
        return self._timed("reduce_scatter", lambda: self.inner.reduce_scatter(buf, op, group, timeout),
                           _nbytes(buf))

    def barrier(self, group: Any, timeout: float) -> None:
        self._timed("barrier", lambda: self.inner.barrier(group, timeout), None)

    def p2p(self) -> _TracedP2P:
        inner = self.inner.p2p()  # a re-formed world (reform) has a new transport: wrap that one
        if self._p2p is None or self._p2p.inner is not inner:
            self._p2p = _TracedP2P(inner, self._recorder)
        return self._p2p


def clock_offsets(stamps: Any, hosts: list[str]) -> list[int]:
    """Each rank's clock minus rank 0's, in ns, from ``stamps[rank][round]`` taken right after a barrier.

    Ranks on rank 0's host share its monotonic clock: their offset is exactly 0. Elsewhere it is the median
    over rounds of the difference to rank 0's stamp (a barrier's exit skew is one message latency).
    """
    rows = [[int(v) for v in row] for row in stamps]
    return [0 if hosts[r] == hosts[0] else int(statistics.median(a - b for a, b in zip(row, rows[0])))
            for r, row in enumerate(rows)]


def _align(world: Any, timeout: float) -> tuple[int, int, bool]:
    """(this rank's clock offset to rank 0, the run's id, aligned?) agreed over the world (collective)."""
    if world.size == 1:
        return 0, time.time_ns(), True
    if world.generation > 0:  # a re-formed world: its survivors are not in start_trace with us
        return 0, 0, world.hostname == world.hostnames[0]
    engine = world.engine  # never a TracedEngine here: start() refuses while tracing is on
    stamps = np.zeros(ALIGN_ROUNDS + 1, dtype=np.int64)
    for k in range(ALIGN_ROUNDS):
        engine.barrier(world.handle, timeout)
        stamps[k] = _now()
    stamps[-1] = time.time_ns()  # rank 0's becomes the run id
    rows = engine.all_gather(stamps, world.handle, timeout)
    offsets = clock_offsets([row[:-1] for row in rows], world.hostnames)
    return offsets[world.rank], int(rows[0][-1]), True


def start(world: Any, directory: str | os.PathLike[str], *, capacity: int = trace.DEFAULT_CAPACITY,
          timeout: float | None = None) -> trace.Recorder:
    """Record this rank's timeline into ``directory`` until :func:`stop` (``World.start_trace``).

    Collective over the world (the clocks are aligned to rank 0's). Every rank must pass the same
    ``directory``; on several hosts it should be a shared file system, or the launcher's host merges
    only the files it sees. Starting again while tracing is a ConfigError: stop first.
    """
    if trace.ACTIVE is not None:
        raise ConfigError(f"tracing is already on (into {trace.ACTIVE.directory}): call stop_trace() first")
    folder = trace.trace_folder(directory)
    name = world.roster[world.rank]  # its launcher number: the rank, unless an elastic world renumbered it
    with contextlib.suppress(FileNotFoundError):
        trace.rank_file(folder, name).unlink()  # a file of an earlier run must not be merged with ours
    offset, run, aligned = _align(world, world.default_timeout if timeout is None else timeout)
    recorder = trace.Recorder(folder, name, world.size, world.hostname, offset, run, capacity, aligned)
    world.engine = TracedEngine(world.engine, recorder)
    trace.ACTIVE = recorder
    _write_on_sigterm(recorder)
    return recorder


def _write_on_sigterm(recorder: trace.Recorder) -> None:
    """A rank torn down by the launcher (SIGTERM, when a peer failed) still leaves its file, then dies of
    the signal as it would have. Only where SIGTERM has its default action and in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def write_and_die(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            recorder.write()
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, write_and_die)


def _restore_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if getattr(handler, "__name__", "") == "write_and_die":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stop(world: Any, *, merge: bool | None = None) -> Path | None:
    """Stop recording, write this rank's file and, unless the launcher merges, merge when all are there.

    Not collective. ``merge``: None (default) merges unless ``popmesh launch --trace`` started the run.
    Returns the merged file's path where this rank wrote it, else this rank's file (None if not tracing).
    """
    recorder = trace.ACTIVE
    if isinstance(world.engine, TracedEngine):
        world.engine = world.engine.inner
    if recorder is None:
        return None
    trace.ACTIVE = None
    _restore_sigterm()
    own = recorder.write()
    if merge is None:
        merge = os.environ.get(LAUNCHER_MERGES_ENV) != "launcher"
    if not merge:
        return own
    members = list(world.roster)  # the world's ranks now, by the launcher numbers their files are named by
    if world.rank == 0:
        trace.wait_for_ranks(recorder.directory, members, MERGE_WAIT_S)
    if world.rank == 0 or trace.all_ranks_written(recorder.directory, members):
        return trace.merge_traces(recorder.directory) or own
    return own
