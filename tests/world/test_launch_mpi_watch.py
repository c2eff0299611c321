"""`popmesh launch --engine mpi` watches its ranks: a rank of any script (popmesh imported or not)
that raises, exits non-zero or is killed takes the world down within seconds; the root cause names
the rank that raised, exited or was killed (mpiexec itself gives only its own exit code). A killed
rank leaves no record: the launcher names it from its watch of the ranks' end pipes and pids
(popmesh.launch.rankwatch), exactly where the kernel releases a dying process's files highest first."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import mpiexec
from popmesh.launch.rankwatch import releases_highest_first

SCRIPT = Path(__file__).parent / "scripts" / "mpi_rank_fails.py"


@pytest.mark.timeout(60)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
@pytest.mark.parametrize("how,cause", [
    ("raise", "rank 1 exited with code 1 after raising ValueError: rank 1 gives up"),
    ("exit", "rank 1 exited with code 3 after raising SystemExit: 3"),
    ("kill", "rank 1 was killed by SIGKILL (exit code 137)"),
])
def test_a_failing_rank_is_named_and_the_world_ends(how, cause):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", "3", "--engine", "mpi", str(SCRIPT), how],
                          capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    said = done.stderr + done.stdout
    together = re.search(r"hint: ranks ([\d, ]+) were seen to end together", said)
    if how == "kill" and together is not None and not releases_highest_first():  # no end pipes: it says so
        assert "1" in together[1].split(", "), said[-3000:]
    else:  # the ranks' end pipes order their ends exactly (Hydra's kills of the others come after)
        assert together is None and f"root cause: {cause}" in said, done.stderr[-3000:]
    assert elapsed < 15, f"took {elapsed:.1f} s"  # includes starting three Python processes
