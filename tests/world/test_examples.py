"""The README's example and the collectives tour run as documented, and ranks agree."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _launch(script: str, n: int, engine: str = "torch", *args: str, options: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(n), "--engine", engine, *options,
           str(EXAMPLES / script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_readme_example_ranks_agree(engine):
    out = _launch("average_gradients.py", 2, engine)
    losses = {line.split()[-1] for line in out.splitlines() if line.startswith("[rank")}
    assert len(losses) == 1, out  # every rank printed the same averaged loss


@pytest.mark.timeout(180)
def test_collectives_tour():
    out = _launch("collectives_tour.py", 3)
    assert "average bias over 3 ranks: 1.00 (closed form 1.00)" in out
    assert "replay batches: sizes [1, 2, 3], total 6" in out and "done" in out


@pytest.mark.timeout(180)
def test_training_survives_a_lost_rank():
    out = _launch("survive_a_lost_rank.py", 3, "torch", "--kill-at", "30", options=("--max-restarts", "2"))
    assert "[rank 1] rank 1 rejoined at step 30 (generation 1, from rank 0)" in out, out
    assert all(f"rank {r} done at step 60, generation 1, weights agree: True" in out for r in range(3)), out
