"""``popmesh launch --engine mpi --max-restarts N``: an MPI world cannot take one rank back, so the launcher
restarts the whole job, and the population resumes from its newest checkpoint (tests/world/scripts/
mpi_job_restart.py). Past the budget the run fails, naming the lost rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import mpiexec

pytestmark = [pytest.mark.world, pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")]
SCRIPT = str(Path(__file__).parent / "scripts" / "mpi_job_restart.py")
STEPS, KILL_AT, RANKS = 20, 12, 3


def _launch(folder: Path, budget: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "TORCHELASTIC_"))}
    return subprocess.run([sys.executable, "-m", "popmesh", "launch", "--engine", "mpi", "-n", str(RANKS),
                           "--max-restarts", str(budget), SCRIPT, str(folder), str(STEPS), str(KILL_AT)],
                          capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.timeout(180)
def test_a_lost_rank_restarts_the_whole_job_which_resumes_from_the_last_checkpoint(tmp_path):
    done = _launch(tmp_path, budget=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    total = RANKS * (RANKS + 1) / 2
    want = total * sum(range(STEPS))  # every step exactly once: none lost, none repeated
    lines = re.finditer(r"DONE rank=(\d+) restart=(\d+) weight=([\d.e+]+)", done.stdout)
    finished = {int(m[1]): (int(m[2]), float(m[3])) for m in lines}
    assert finished == {r: (1, want) for r in range(RANKS)}, done.stdout[-3000:]
    resumed = {int(m[1]): int(m[2]) for m in re.finditer(r"RESUMED rank=(\d+) restart=1 step=(\d+)", done.stdout)}
    assert resumed == {r: 10 for r in range(RANKS)}, done.stdout[-3000:]  # the checkpoint before the kill
    killed = float(re.search(r"KILLING rank=1 t=([\d.]+)", done.stdout)[1])
    back = min(float(m[1]) for m in re.finditer(r"RESUMED rank=\d+ restart=1 step=\d+ t=([\d.]+)", done.stdout))
    print(f"from the kill to the resumed job: {back - killed:.2f} s")
    assert back - killed < 30, back - killed
    assert "restarting the whole MPI job (1 of 1)" in done.stderr, done.stderr[-3000:]
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(120)
def test_without_a_restart_left_the_run_fails_naming_the_lost_rank(tmp_path):
    done = _launch(tmp_path, budget=0)
    assert done.returncode != 0 and "DONE" not in done.stdout, done.stdout[-3000:]
    assert "restarting the whole MPI job" not in done.stderr, done.stderr[-3000:]
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr, done.stderr[-3000:]
