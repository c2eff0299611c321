"""``popmesh launch --inject-failures``: the launcher kills random ranks within the restart budget, says so,
records each kill in the log folder's failures.jsonl, and a script that survives a lost rank ends well
(tests/world/scripts/survive.py, no rank dying by itself)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.world
SCRIPT = str(Path(__file__).parent / "scripts" / "survive.py")
_DONE = re.compile(r"DONE rank=(\d+) gen=(\d+) step=(\d+) good=(\w+) restart=(\d+)")


@pytest.mark.timeout(120)
def test_injected_failures_are_survived_and_recorded(tmp_path):
    env = {**os.environ, "POPMESH_TIMEOUT": "60", "SURVIVE_STEP_S": "0.01"}
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "3", "--max-restarts", "1", "--preload", "torch",
           "--inject-failures", "120", "--inject-after", "2.5", "--inject-seed", "3", "--inject-max", "2",
           "--log-dir", str(tmp_path), SCRIPT, "400", "99", "0"]  # rank 99: nobody kills itself
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for path in tmp_path.rglob("failures.jsonl") for line in path.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["injected", "injected"], (records, done.stderr[-2000:])
    killed = [r["rank"] for r in records]
    assert len(set(killed)) == 2 and all(r["restarts_left"] == 1 and r["signal"] == "SIGKILL" for r in records)
    assert all(f"SIGKILL to rank {rank}" in done.stderr for rank in killed), done.stderr[-2000:]
    ended = {int(m[1]): (int(m[3]), m[4] == "True", int(m[5])) for m in _DONE.finditer(done.stdout)}
    assert ended == {r: (400, True, int(r in killed)) for r in range(3)}, done.stdout[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options,message", [
    (["--inject-failures", "2"], r"restart budget, and there is none: add --max-restarts N"),
    (["--inject-failures", "0", "--max-restarts", "1"], r"--inject-failures 0.0: give the mean number of kills"),
    (["--inject-failures", "2", "--max-restarts", "1", "--engine", "mpi"], r"only the torch engine restarts a lost"),
    (["--inject-seed", "4"], r"--inject-seed shapes --inject-failures, which is not given"),
])
def test_injection_without_a_restart_budget_is_refused(options, message):
    done = subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", "2", *options, SCRIPT, "10", "99", "0"],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode != 0 and re.search(message, done.stderr), done.stderr[-2000:]
