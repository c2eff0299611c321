"""The trace timeline without processes: recorder, engine wrapper, clock offsets, merge, reading back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import popmesh
from popmesh.comm import tracing
from popmesh.comm.tracing import TracedEngine, clock_offsets
from popmesh.core import trace
from popmesh.core.errors import CommTimeout, ConfigError
from popmesh.core.handles import Completed
from popmesh.core.trace import Recorder, merge_traces, rank_file
from popmesh.launch.options import configure, launch_options
from popmesh.launch.timeline import trace_env
from popmesh.observe.reports import Timer
from popmesh.observe.trace import imbalance_from_trace, load_trace, span_timings
from popmesh.population.mechanisms.info import Clock


@pytest.fixture(autouse=True)
def no_active_recorder():
    popmesh.finalize()
    trace.ACTIVE = None
    yield
    popmesh.finalize()
    trace.ACTIVE = None


# ---- recorder ---------------------------------------------------------------------------------------
def test_recorder_keeps_the_newest_spans_and_counts_the_rest(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, rank=0, size=1, capacity=3)
    for i in range(5):
        rec.add(f"s{i}", "user", 100 * i, 100 * i + 10)
    assert [s[0] for s in rec.spans] == ["s2", "s3", "s4"] and rec.dropped == 2
    with pytest.raises(ConfigError, match="at least 1"):
        Recorder(tmp_path, 0, 1, capacity=0)


def test_a_span_is_recorded_when_its_body_raises_and_the_offset_shifts_it(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, rank=1, size=2, host="h", offset_ns=1_000)
    with pytest.raises(ValueError), rec.span("work", x=3):
        raise ValueError("boom")
    (name, cat, tid, start, dur, args), = rec.spans
    assert (name, cat, args) == ("work", "user", {"x": 3}) and dur >= 0
    data = json.loads(rec.write().read_text())
    assert data["spans"][0][3] == start - 1_000 and data["rank"] == 1 and data["host"] == "h"
    assert data["threads"][str(tid)] == "MainThread"


def test_module_span_does_nothing_while_tracing_is_off(tmp_path: Path) -> None:
    with trace.span("ignored"):
        pass
    trace.record("ignored", "user", 0, 1)
    rec = trace.ACTIVE = Recorder(tmp_path, 0, 1)
    with trace.span("kept", cat="c"):
        pass
    assert [(s[0], s[1]) for s in rec.spans] == [("kept", "c")]


# ---- merge ------------------------------------------------------------------------------------------
def _rank(tmp: Path, rank: int, size: int, spans: list[tuple[str, int, int]], *, run: int = 7, offset: int = 0,
          host: str = "node") -> None:
    rec = Recorder(tmp, rank, size, host, offset_ns=offset, run=run)
    for name, start, end in spans:
        rec.add(name, "comm", start, end, {"bytes": 8})
    rec.write()


def test_merge_gives_one_track_per_rank_on_rank_zeros_clock(tmp_path: Path) -> None:
    _rank(tmp_path, 0, 3, [("all_reduce", 5_000, 9_000)])
    _rank(tmp_path, 2, 3, [("all_reduce", 1_006_000, 1_009_000)], offset=1_000_000, host="other")
    _rank(tmp_path, 1, 3, [("stale", 0, 1)], run=3)  # an earlier run's file in the same folder
    (tmp_path / "rank-9.trace.json").write_text("{not json")
    data = load_trace(merge_traces(tmp_path) or "")
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in spans] == [
        (0, "all_reduce", 0.0, 4.0), (2, "all_reduce", 1.0, 3.0)]
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (node)", 2: "rank 2 (other)"}
    assert data["displayTimeUnit"] == "ms" and data["metadata"]["missing_ranks"] == [1]
    assert merge_traces(tmp_path / "empty") is None


def test_clock_offsets_are_exact_on_rank_zeros_host_and_medians_elsewhere() -> None:
    stamps = [[100, 200, 300], [105, 204, 306], [1_100, 1_190, 1_400]]
    assert clock_offsets(stamps, ["a", "a", "b"]) == [0, 0, 1_000]


# ---- the engine wrapper -----------------------------------------------------------------------------
class FakeP2P:
    def send(self, frame: Any, dst: int, tag: int, timeout: float) -> None:
        if timeout <= 0:
            raise CommTimeout("send timed out")

    def recv(self, src: Any, tag: int, timeout: float) -> tuple[int, Any]:
        return 1, np.zeros(12, np.uint8)

    def isend(self, frame: Any, dst: int, tag: int) -> Any:
        return Completed()

    def irecv(self, src: Any, tag: int) -> Any:
        class Req(Completed):
            def result(self) -> Any:
                return (2, np.zeros(5, np.uint8))

        return Req((2, np.zeros(5, np.uint8)))


class FakeEngine:
    name, rank, size = "fake", 0, 2

    def __init__(self) -> None:
        self._p2p = FakeP2P()
        self.calls: list[str] = []

    def all_reduce_(self, buf: Any, op: Any, group: Any, timeout: float) -> None:
        self.calls.append("all_reduce_")
        buf *= 2

    def all_reduce_start(self, buf: Any, op: Any, group: Any) -> Any:
        return Completed()

    def all_gather(self, buf: Any, group: Any, timeout: float) -> Any:
        return np.stack([buf, buf])

    def barrier(self, group: Any, timeout: float) -> None:
        self.calls.append("barrier")

    def p2p(self) -> FakeP2P:
        return self._p2p


def test_the_traced_engine_hands_calls_on_and_records_each(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, 0, 2)
    engine = TracedEngine(FakeEngine(), rec)
    buf = np.ones(4, np.float32)
    engine.all_reduce_(buf, "sum", None, 1.0)
    assert buf.tolist() == [2.0] * 4 and engine.name == "fake" and engine.calls == ["all_reduce_"]
    assert engine.all_gather(buf, None, 1.0).shape == (2, 4)
    engine.barrier(None, 1.0)
    engine.all_reduce_start(buf, "sum", None).wait(1.0)
    p2p = engine.p2p()
    assert p2p is engine.p2p()
    p2p.send([np.zeros(3, np.uint8), b"ab"], 1, 5, 1.0)
    with pytest.raises(CommTimeout):
        p2p.send(b"x", 1, 5, 0.0)
    assert p2p.recv(None, 6, 1.0)[0] == 1
    p2p.isend(b"abcd", 1, 7).wait(1.0)
    pending = p2p.irecv(None, 8)
    assert pending.done() and pending.done() and pending.wait(1.0)[0] == 2  # one span, at the first done()
    got = [(s[0], s[5]) for s in rec.spans]
    assert got == [
        ("all_reduce", {"bytes": 16}), ("all_gather", {"bytes": 16}), ("barrier", None),
        ("all_reduce", {"bytes": 16, "async": True}),
        ("send", {"dst": 1, "tag": 5, "bytes": 5}), ("send", {"dst": 1, "tag": 5, "bytes": 1}),
        ("recv", {"tag": 6, "src": 1, "bytes": 12}), ("send", {"dst": 1, "tag": 7, "bytes": 4, "async": True}),
        ("recv", {"tag": 8, "async": True, "src": 2, "bytes": 5}),
    ]


def _calls_into_tracing(fn: Any) -> list[str]:
    """The functions of the tracing modules that run during ``fn()`` (a profiler sees every call)."""
    files = (trace.__file__, tracing.__file__)
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename in files:
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_off_means_no_call_into_tracing_and_on_records(tmp_path: Path) -> None:
    world = popmesh.init("local")
    engine = world.engine

    def hot_path() -> None:
        timer, clock = Timer(), Clock()
        with timer.section("step"):
            clock.lap("decide")
            popmesh.all_reduce(np.ones(3))

    assert _calls_into_tracing(hot_path) == []
    world.start_trace(tmp_path)
    assert isinstance(world.engine, TracedEngine) and world.engine.inner is engine
    assert "add" in _calls_into_tracing(hot_path)
    world.finalize()
    assert world.engine is engine and trace.ACTIVE is None
    spans = [e for e in load_trace(tmp_path)["traceEvents"] if e["ph"] == "X"]
    assert {(e["cat"], e["name"]) for e in spans} == {("timer", "step"), ("population", "population.decide")}


def test_starting_twice_is_refused_and_init_reads_the_folder_from_the_environment(tmp_path: Path,
                                                                                 monkeypatch: Any) -> None:
    monkeypatch.setenv(trace.TRACE_ENV, str(tmp_path / "env"))
    world = popmesh.init("local")
    assert trace.ACTIVE is not None and trace.ACTIVE.directory == tmp_path / "env"
    with pytest.raises(ConfigError, match="stop_trace"):
        world.start_trace(tmp_path / "again")
    assert world.stop_trace() == tmp_path / "env" / "trace.json"
    assert world.stop_trace() is None


# ---- reading back, the straggler report -------------------------------------------------------------
def _chrome(phases: dict[int, list[tuple[str, float]]]) -> dict[str, Any]:
    events = []
    for rank, spans in phases.items():
        ts = 0.0
        for name, seconds in spans:
            events.append({"name": name, "cat": "timer", "ph": "X", "ts": ts, "dur": seconds * 1e6, "pid": rank,
                           "tid": 1})
            ts += seconds * 1e6
    events.append({"name": "all_reduce", "cat": "comm", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 1})
    return {"traceEvents": events, "metadata": {"ranks": sorted(phases), "missing_ranks": []}}


def test_the_imbalance_report_from_spans_names_the_straggler_and_its_cost() -> None:
    # rank r takes (r+1) s in "rollout" (rank 2 is slowest every time); in "train" rank 0 is slow once
    phases = {r: [("rollout", r + 1.0), ("train", 1.0), ("rollout", r + 1.0), ("train", 3.0 if r == 0 else 1.0)]
              for r in range(3)}
    data = _chrome(phases)
    assert span_timings(data)[1] == {"rollout": [2.0, 2.0], "train": [1.0, 1.0]}
    assert span_timings(data, categories=None, names=["all_reduce"])[0] == {"all_reduce": [5e-6]}
    report = imbalance_from_trace(data)
    rollout, train = report.steps
    assert rollout.slowest_rank == 2 and rollout.caused == (0.0, 0.0, 2 * (2.0 + 1.0))
    assert rollout.wait_caused == pytest.approx(6.0)
    assert train.slowest_rank == 0 and train.wait_caused == pytest.approx(4.0)
    _, headers, rows, notes = report.table()
    assert rows[0][headers.index("slowest\nrank")] == "2" and rows[0][headers.index("wait\ncaused s")] == "6"
    assert any(n.startswith("straggler: rank 2 in step 'rollout'") for n in notes)
    assert report.to_dict()["steps"][1]["wait_caused"] == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="no spans"):
        imbalance_from_trace({"traceEvents": []})


def test_load_trace_says_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the trace"):
        load_trace(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a Chrome trace"):
        load_trace(tmp_path / "x.json")


# ---- the launcher's side ----------------------------------------------------------------------------
def test_launch_trace_option_and_environment(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    kwargs, _ = launch_options(parser.parse_args(["--trace", "out", "script.py"]))
    assert kwargs["trace"] == "out"
    env = trace_env(str(tmp_path / "t"))
    assert env == {trace.TRACE_ENV: str((tmp_path / "t").resolve()), tracing.LAUNCHER_MERGES_ENV: "launcher"}
    assert (tmp_path / "t").is_dir() and rank_file(tmp_path, 3).name == "rank-3.trace.json"


def test_a_reformed_worlds_new_transport_is_the_one_traced(tmp_path: Path) -> None:
    inner = FakeEngine()
    engine = TracedEngine(inner, Recorder(tmp_path, 0, 2))
    first = engine.p2p()
    inner._p2p = FakeP2P()  # what reform() does: a new point-to-point transport
    assert engine.p2p() is not first and engine.p2p().inner is inner._p2p


def test_init_with_trace_on_an_existing_world_is_refused_unless_it_already_records_there(tmp_path: Path) -> None:
    import popmesh
    from popmesh.core.errors import ConfigError

    world = popmesh.init("local")
    try:
        with pytest.raises(ConfigError, match=r"trace= applies only when init creates the world.*start_trace"):
            popmesh.init("local", trace=tmp_path / "timeline")
        assert not (tmp_path / "timeline").exists()  # the refusal creates nothing
        world.start_trace(tmp_path / "timeline")
        assert popmesh.init("local", trace=tmp_path / "timeline") is world
        with pytest.raises(ConfigError, match="records into"):
            popmesh.init("local", trace=tmp_path / "elsewhere")
        world.stop_trace()
    finally:
        world.finalize()
