"""Wide worlds on one box: 32 ranks form and compute on torch and MPI, with a handful of threads per rank."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness import mpiexec

SCRIPT = Path(__file__).parent / "scripts" / "wide_world.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_a_32_rank_world_on_one_box(engine):
    """gloo receives on one any-source thread beyond 8 peers instead of one thread per peer. The torch ranks
    are forked (--preload torch): 32 imports of torch would be most of the test's time."""
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    forked = ["--preload", "torch"] if engine == "torch" else []
    done = subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", "32", "--engine", engine, *forked,
                           str(SCRIPT)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WIDE size=32" in done.stdout, done.stdout[-3000:]
