"""`popmesh launch` used like torchrun, with real processes: the variables the ranks see, --log-dir files,
--standalone, and options it refuses. Every world here runs a tiny script (no engine import), so each
test takes well under a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.world
HAS_MPI = importlib.util.find_spec("mpi4py") is not None and os.access(Path(sys.executable).parent / "mpiexec", os.X_OK)
WORKER = """\
import json, os, sys, time
rank = os.environ.get("RANK") or os.environ.get("PMI_RANK")
print("ENV " + json.dumps(dict(os.environ)))
print(f"out of {rank}")
print(f"err of {rank}", file=sys.stderr, flush=True)
done = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0.done")
if rank == "0":
    open(done, "w").close()
if "fail" in sys.argv[1:] and rank == "1":
    deadline = time.monotonic() + 20
    while not os.path.exists(done) and time.monotonic() < deadline:  # rank 0 has written its lines
        time.sleep(0.01)
    raise ValueError("rank 1 fails on purpose")
"""


@pytest.fixture
def worker(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def popmesh(*args: str, unset: tuple[str, ...] = (), timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m popmesh ARGS`` to completion, without the variables named in ``unset``."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([sys.executable, "-m", "popmesh", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def envs(stdout: str) -> dict[int, dict[str, str]]:
    """Each rank's environment, by RANK, from the worker's ``ENV {...}`` lines."""
    found = (json.loads(m) for m in re.findall(r"^\[rank \d+\] ENV (.*)$", stdout, re.M))
    return {int(e["RANK"]): e for e in found}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_ranks_see_torchelastic_variables(n: int, worker: str) -> None:
    proc = popmesh("launch", "-np", str(n), "--rdzv_id", "job7", "--role", "trainer", "--max_restarts", "0",
                   worker, unset=("TORCH_NCCL_ASYNC_ERROR_HANDLING",))
    assert proc.returncode == 0, proc.stderr
    seen = envs(proc.stdout)
    assert sorted(seen) == list(range(n))
    for rank, e in seen.items():
        assert (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) == (str(rank), str(n), str(n))
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert (e["ROLE_NAME"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == ("trainer", str(rank), str(n))
        assert (e["TORCHELASTIC_RUN_ID"], e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == (
            "job7", "0", "0")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False" and e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert e["TORCHELASTIC_ERROR_FILE"] == e["POPMESH_ERROR_FILE"]
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"rank-{rank}.json")


@pytest.mark.timeout(30)
def test_log_dir_holds_each_ranks_logs_as_torchrun_lays_them_out(worker: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = popmesh("launch", "--nproc_per_node", "2", "--log_dir", str(logs), worker, "fail")
    assert proc.returncode == 1
    (attempt,) = logs.glob("*/attempt_0")
    run_id = envs(proc.stdout)[0]["TORCHELASTIC_RUN_ID"]
    assert attempt.parent.name.startswith(f"{run_id}_") and f"rank logs in {attempt}" in proc.stderr
    for rank in (0, 1):  # --log-dir alone tees: the files and the console both have every line
        assert f"out of {rank}\n" in (attempt / str(rank) / "stdout.log").read_text()
        assert (attempt / str(rank) / "stderr.log").read_text().startswith(f"err of {rank}\n")
        assert f"[rank {rank}] out of {rank}" in proc.stdout and f"[rank {rank}] err of {rank}" in proc.stderr
    assert "ValueError: rank 1 fails on purpose" in (attempt / "1" / "stderr.log").read_text()
    record = json.loads((attempt / "1" / "error.json").read_text())
    assert (record["rank"], record["type"]) == (1, "ValueError") and not (attempt / "0" / "error.json").exists()

    quiet = popmesh("launch", "-n", "2", "--log-dir", str(logs), "--redirects", "3", "--rdzv-id", "r", worker)
    assert quiet.returncode == 0, quiet.stderr
    assert "[rank" not in quiet.stdout and "[rank" not in quiet.stderr
    (attempt,) = logs.glob("r_*/attempt_0")
    assert [(attempt / str(r) / "stdout.log").read_text().splitlines()[1] for r in (0, 1)] == ["out of 0", "out of 1"]


@pytest.mark.timeout(30)
def test_standalone_is_one_node_on_a_free_loopback_port(worker: str) -> None:
    proc = popmesh("launch", "--standalone", "--nnodes", "1", "-n", "2", "--master-port", "1", worker)
    assert proc.returncode == 0, proc.stderr
    assert "popmesh launch: warning: --standalone picks a free port on loopback" in proc.stderr
    seen = envs(proc.stdout)
    assert {e["MASTER_ADDR"] for e in seen.values()} == {"127.0.0.1"}
    (port,) = {int(e["MASTER_PORT"]) for e in seen.values()}
    assert port > 1024
    (run_id,) = {e["TORCHELASTIC_RUN_ID"] for e in seen.values()}
    assert str(uuid.UUID(run_id)) == run_id


@pytest.mark.timeout(30)
def test_max_restarts_and_unknown_options_are_refused_before_any_rank_starts(worker: str) -> None:
    proc = popmesh("launch", "-n", "2", "--engine", "jax", "--max-restarts", "1", worker)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "popmesh launch: error: --max-restarts 1 with --engine jax: jax.distributed cannot take" in proc.stderr
    proc = popmesh("launch", "--nproc-per-node", "2", "--monitor_interval", "1", "--nope", worker)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: popmesh launch ") and "unrecognized arguments: --nope" in proc.stderr


@pytest.mark.mpi
@pytest.mark.timeout(30)
@pytest.mark.skipif(not HAS_MPI, reason="needs mpi4py and the venv's mpiexec")
def test_mpi_ranks_are_logged_by_their_rank(worker: str, tmp_path: Path) -> None:
    proc = popmesh("launch", "--engine", "mpi", "-n", "2", "--log-dir", str(tmp_path), "-r", "1", worker)
    assert proc.returncode == 0, proc.stderr
    (attempt,) = tmp_path.glob("*/attempt_0")
    for rank in (0, 1):
        assert f"out of {rank}\n" in (attempt / str(rank) / "stdout.log").read_text()
        assert not (attempt / str(rank) / "stderr.log").exists()
        assert f"[rank {rank}] err of {rank}" in proc.stderr
    assert "out of" not in proc.stdout
