"""benchmarks/_ray_gfn.py: Ray Tune PBT around one hypergrid GFlowNet trainer per trial, at a small size
(2-D, height 8, R0 0.1, 2 trials, 30 iterations, a validation and a possible perturbation every 10).
Each trial starts at the example's learning rate for its rank and trains exactly as the example's
agent does until the scheduler first touches it (its L1 at iterations 0 and 10 equal an in-process
``hypergrid_agent.Agent``'s); an exploited trial keeps its rank and iteration count."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("gfn")
pytestmark = pytest.mark.world

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import torch
from hypergrid_agent import Agent, Grid, start_lr

from _ray_gfn import GridSetup, run

SEED, RANGE, ITERATIONS, EVERY = 3, (1e-4, 0.1), 30, 10


def reference(rank: int) -> dict[int, float]:
    """The example's agent for ``rank``, trained in this process: its L1 at the first two validations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        agent = Agent(Grid(2, 8, 0.1), seed=SEED, rank=rank, lr=start_lr(RANGE, SEED, rank))
        found = {}
        for it in range(EVERY + 1):
            agent.step()
            if it % EVERY == 0:
                found[it] = agent.l1()
        return found
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(300)  # about 20 s alone; Ray starts a dozen processes, slow beside CPU-bound ones
def test_a_trial_trains_the_example_agent():
    out = tempfile.mkdtemp(prefix="ray-gfn-")  # short: Ray's socket paths under it must fit in 107 bytes
    try:
        records, started, total = run(GridSetup("pbt", SEED, ITERATIONS, EVERY, RANGE, 2, out, height=8, r0=0.1))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    starts = sorted((r for r in records if r["kind"] == "start"), key=lambda r: r["rank"])
    assert [r["rank"] for r in starts] == [0, 1], starts
    assert [r["lr"] for r in starts] == [pytest.approx(start_lr(RANGE, SEED, r), rel=1e-5) for r in (0, 1)]
    rank_of = {r["trial"]: r["rank"] for r in starts}
    rows = [r for r in records if r["kind"] == "row"]
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["iteration"] for r in mine] == [0, 10, 20, 29], mine  # its own count, across exploits
        assert [r["steps"] for r in mine] == [16, 176, 336, 480]
        assert {r["iteration"]: r["l1"] for r in mine[:2]} == pytest.approx(reference(rank), abs=1e-6)
    for restore in (r for r in records if r["kind"] == "restore"):
        assert rank_of[restore["trial"]] in (0, 1) and RANGE[0] <= restore["lr"] <= RANGE[1], restore
    assert total > 0 and all(r["time"] >= started for r in rows)
