"""Point-to-point messages on real worlds: local (1 rank), torch/gloo and MPI at 2 and 3 ranks (worlds
shared with the other communication files: suite "comm")."""

import subprocess
import sys
from pathlib import Path

import pytest

from workers import messages_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("local", 1), ("torch", 2), ("torch", 3), ("mpi", 2), ("mpi", 3)], timeout=240, suite="comm"
)
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [3, 3, 3, 2])
def test_gloo_goodbyes_end_pumps_and_exits_are_clean(size):
    """Repeated because a pump left waiting at exit aborts only some of the time."""
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(size), "--engine", "torch",
           str(SCRIPTS / "p2p_goodbye.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"[rank {r}] rank {r} OK" in done.stdout for r in range(size - 1)), done.stdout[-3000:]
    early = next(line for line in done.stdout.splitlines() if "EARLY finalized" in line)
    assert float(early.split()[-2]) < 1.5, early  # the live peers answered its goodbye at once
