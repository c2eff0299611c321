"""`popmesh launch --trace DIR` on a script that never mentions tracing: the ranks record, the launcher
merges DIR/trace.json, read back here (one track per rank, the calls the script made, clocks aligned, the
straggler named from the spans). A rank that dies leaves the others' timelines merged."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness import mpiexec
from popmesh.observe.trace import imbalance_from_trace, load_trace

SCRIPT = Path(__file__).parent / "scripts" / "trace_world.py"


def _launch(out: Path, engine: str, n: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", str(n), "--engine", engine,
                           "--trace", str(out), str(SCRIPT), *args], capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", [
    "torch", pytest.param("mpi", marks=pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed"))])
def test_launch_trace_merges_every_ranks_timeline(tmp_path: Path, engine: str) -> None:
    done = _launch(tmp_path / "t", engine, 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trace in" in done.stderr and "ui.perfetto.dev" in done.stderr
    data = load_trace(tmp_path / "t" / "trace.json")
    assert data["metadata"]["missing_ranks"] == [] and data["metadata"]["unaligned_ranks"] == []
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [e["name"] for e in spans if e["pid"] == rank]
        assert names.count("work") == 3 and names.count("send") == 3 and names.count("recv") == 3, names
        assert "all_reduce" in names and "barrier" in names
        recvs = [e["args"] for e in spans if e["pid"] == rank and e["name"] == "recv"]
        assert all(a["src"] == 1 - rank and a["bytes"] > 24 for a in recvs), recvs
    labels = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert sorted(labels) == [0, 1] and labels[0].startswith("rank 0 (")
    # the final barrier ends at about the same moment on both ranks' (aligned) clocks
    ends = [max(e["ts"] + e["dur"] for e in spans if e["pid"] == r and e["name"] == "barrier") for r in (0, 1)]
    assert abs(ends[0] - ends[1]) < 50_000, ends  # µs
    work = imbalance_from_trace(data).steps[0]
    assert work.name == "work" and work.slowest_rank == 1 and work.wait_caused > 0.05


@pytest.mark.timeout(120)
def test_a_rank_that_dies_leaves_the_others_trace(tmp_path: Path) -> None:
    done = _launch(tmp_path / "t", "torch", 2, "die")
    assert done.returncode != 0
    data = load_trace(tmp_path / "t" / "trace.json")
    assert data["metadata"]["ranks"] == [0] and data["metadata"]["missing_ranks"] == [1], done.stderr[-3000:]
    assert [e["name"] for e in data["traceEvents"] if e["ph"] == "X"].count("all_reduce") >= 3
