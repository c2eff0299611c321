"""The trace recorder every layer writes spans into, and the files it leaves (one per rank, then merged).

Tracing is off unless a run asks for it (``popmesh launch --trace DIR``, ``POPMESH_TRACE=DIR``,
``popmesh.init(trace=DIR)``, :func:`popmesh.comm.tracing.start_trace`). Off, :data:`ACTIVE` is None and
nothing on a hot path calls anything: the engine is wrapped for tracing only while it is on, and the
few other hooks test ``trace.ACTIVE is not None`` first. On, each rank keeps its spans in memory (a
bounded ring: the newest ``capacity`` spans), stamped with ``time.perf_counter_ns`` (the host's
monotonic clock) and shifted onto rank 0's clock by the offset agreed when tracing started. At the end
each rank writes ``DIR/rank-R.trace.json`` (R: its launcher number, its rank unless an elastic world
renumbered it); :func:`merge_traces` joins the ranks' files into one Chrome
trace event file (``DIR/trace.json``: one process per rank, one thread per thread) that
https://ui.perfetto.dev and chrome://tracing open. A rank that died leaves no file; the others merge.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from popmesh.core.errors import ConfigError

__all__ = [
    "ACTIVE", "Recorder", "span", "record", "rank_file", "read_rank_file", "chrome_events", "merge_traces",
    "all_ranks_written", "wait_for_ranks", "trace_folder", "DEFAULT_CAPACITY", "MERGED_NAME", "TRACE_ENV",
]

TRACE_ENV = "POPMESH_TRACE"  # the folder every rank's init() traces into (set by `popmesh launch --trace`)
DEFAULT_CAPACITY = 500_000  # spans kept per rank (the newest); about 50 MB of JSON at most
MERGED_NAME = "trace.json"
_RANK_FILE = re.compile(r"^rank-(\d+)\.trace\.json$")
_FORMAT = 1

Span = tuple[str, str, int, int, int, Mapping[str, Any] | None]  # name, cat, tid, start ns, duration ns, args


class Recorder:
    """This rank's spans, in memory: ``add`` is cheap (a tuple into a bounded deque, no I/O).

    ``offset_ns`` turns this host's monotonic clock into rank 0's (0 on rank 0's host); ``run`` tells the
    files of one run from older ones in the same folder.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, size: int, host: str = "",
                 offset_ns: int = 0, run: int = 0, capacity: int = DEFAULT_CAPACITY, aligned: bool = True) -> None:
        if capacity < 1:
            raise ConfigError(f"trace capacity must be at least 1 span, got {capacity}")
        self.directory = Path(directory)
        self.rank, self.size, self.host = rank, size, host
        self.offset_ns, self.run, self.aligned = offset_ns, run, aligned
        self.spans: deque[Span] = deque(maxlen=capacity)
        self.added = 0
        self.threads: dict[int, str] = {}

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, args: Mapping[str, Any] | None = None) -> None:
        """One finished span on the calling thread (times from ``time.perf_counter_ns``)."""
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        self.spans.append((name, cat, tid, start_ns, end_ns - start_ns, args))
        self.added += 1

    @contextmanager
    def span(self, name: str, cat: str = "user", **args: Any) -> Iterator[None]:
        """Record the body of the ``with`` block (also when it raises)."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), args or None)

    @property
    def dropped(self) -> int:
        """Spans pushed out of the ring by newer ones."""
        return self.added - len(self.spans)

    def to_dict(self) -> dict[str, Any]:
        """The rank file's content: spans with start times on rank 0's clock (ns)."""
        shift = self.offset_ns
        return {
            "format": _FORMAT, "rank": self.rank, "size": self.size, "host": self.host, "pid": os.getpid(),
            "run": self.run, "aligned": self.aligned, "dropped": self.dropped,
            "threads": {str(tid): name for tid, name in self.threads.items()},
            "spans": [[n, c, t, s - shift, d, a] for n, c, t, s, d, a in self._copy()],
        }

    def _copy(self) -> list[Span]:
        """The spans now (a thread that records meanwhile can make one copy fail: take another)."""
        for _ in range(100):
            try:
                return list(self.spans)
            except RuntimeError:  # deque mutated during iteration
                continue
        return []

    def write(self) -> Path:
        """Write ``DIR/rank-R.trace.json`` (atomically: a reader never sees half a file)."""
        path = rank_file(self.directory, self.rank)
        _write_json(path, self.to_dict())
        return path


ACTIVE: Recorder | None = None


def span(name: str, cat: str = "user", **args: Any) -> AbstractContextManager[None]:
    """``with span("rollout"): ...`` records a span when tracing is on and does nothing otherwise."""
    recorder = ACTIVE
    if recorder is None:
        return nullcontext()
    return recorder.span(name, cat, **args)


def record(name: str, cat: str, start_ns: int, end_ns: int, args: Mapping[str, Any] | None = None) -> None:
    """Add a finished span when tracing is on (times from ``time.perf_counter_ns``)."""
    recorder = ACTIVE
    if recorder is not None:
        recorder.add(name, cat, start_ns, end_ns, args)


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its spans."""
    return Path(directory) / f"rank-{rank}.trace.json"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":"), default=str))
    os.replace(tmp, path)


def read_rank_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A rank file's content, or None if it is unreadable or not one (it is then left out of a merge)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and data.get("format") == _FORMAT and isinstance(data.get("spans"), list)
    return data if ok else None


def _rank_files(directory: Path) -> list[dict[str, Any]]:
    """The readable rank files of the run most files in ``directory`` belong to, and those of ranks that
    joined it later (restarted for a lost rank: they could not agree on the run's id)."""
    found = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if _RANK_FILE.match(entry.name):
            data = read_rank_file(entry)
            if data is not None:
                found.append(data)
    if not found:
        return []
    runs = Counter(d["run"] for d in found if d["run"])
    run = max(runs, key=lambda r: (runs[r], r)) if runs else None
    return [d for d in found if d["run"] in (run, 0)]  # run 0: a rank restarted into a formed world


def chrome_events(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chrome trace events of the ranks' files: one process per rank, named ``rank R (host)``, µs from
    the earliest span. Metadata events name the processes and threads."""
    start = min((s[3] for d in ranks for s in d["spans"]), default=0)
    events: list[dict[str, Any]] = []
    for data in sorted(ranks, key=lambda d: d["rank"]):
        rank = data["rank"]
        label = f"rank {rank} ({data['host']})" if data.get("host") else f"rank {rank}"
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, name in data.get("threads", {}).items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": int(tid), "args": {"name": name}})
        for name, cat, tid, begin, dur, args in sorted(data["spans"], key=lambda s: s[3]):
            event = {"name": name, "cat": cat, "ph": "X", "ts": (begin - start) / 1000, "dur": dur / 1000,
                     "pid": rank, "tid": tid}
            if args:
                event["args"] = args
            events.append(event)
    return events


def merge_traces(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path | None:
    """Join the rank files in ``directory`` into one Chrome trace (default ``directory/trace.json``).

    Returns its path, or None when no rank left a file. Ranks missing (died, other host) are named in
    the file's ``metadata`` (``missing_ranks``); the others' spans are all there.
    """
    folder = Path(directory)
    ranks = _rank_files(folder)
    if not ranks:
        return None
    size = max(d["size"] for d in ranks)
    have = {d["rank"] for d in ranks}
    meta = {"ranks": sorted(have), "missing_ranks": [r for r in range(size) if r not in have],
            "dropped_spans": {str(d["rank"]): d["dropped"] for d in ranks if d["dropped"]},
            "unaligned_ranks": sorted(d["rank"] for d in ranks if not d.get("aligned", True))}
    path = Path(out) if out is not None else folder / MERGED_NAME
    _write_json(path, {"traceEvents": chrome_events(ranks), "displayTimeUnit": "ms", "metadata": meta})
    return path


def trace_folder(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a Path, created if need be; ConfigError naming it if it cannot be."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the trace folder {folder} ({e.strerror}): give a writable folder") from e
    return folder


def all_ranks_written(directory: str | os.PathLike[str], ranks: Sequence[int]) -> bool:
    """Whether each of ``ranks`` (the names of their files: launcher numbers) has left its file."""
    return all(rank_file(directory, r).exists() for r in ranks)


def wait_for_ranks(directory: str | os.PathLike[str], ranks: Sequence[int], timeout: float) -> bool:
    """Poll (every 50 ms, at most ``timeout`` s) until each of ``ranks`` has left its file."""
    deadline = time.monotonic() + timeout
    while not all_ranks_written(directory, ranks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
