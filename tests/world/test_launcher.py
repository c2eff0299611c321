"""The launcher with real processes, driven through its CLI (``python -m popmesh launch``).

Every worker records its pid; after the launcher exits no worker may be left alive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from popmesh.launch.plan import thread_share

pytestmark = pytest.mark.world
SCRIPTS = Path(__file__).parent / "scripts"
WORKER = str(SCRIPTS / "launch_worker.py")
HAS_MPI = importlib.util.find_spec("mpi4py") is not None and os.access(Path(sys.executable).parent / "mpiexec", os.X_OK)


def popmesh(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 30):
    """Run ``python -m popmesh ARGS`` to completion and return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "popmesh", *args], env={**os.environ, **(env or {})}, cwd=cwd,
        capture_output=True, text=True, timeout=timeout,
    )


def _alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie waiting to be reaped by init counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(piddir: Path, expected: int, timeout: float = 15) -> list[int]:
    """The pids the workers recorded; waits up to ``timeout`` for all ``expected`` of them."""
    deadline = time.monotonic() + timeout
    while len(list(piddir.glob("*.pid"))) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in sorted(piddir.glob("*.pid"))]
    assert len(pids) == expected, f"{len(pids)} of {expected} workers recorded their pid"
    return pids


def assert_all_gone(pids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:  # clean up before failing, so a bug does not leave processes behind
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"worker processes survived the launcher: {survivors}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_all_ranks_succeed_with_prefixed_separate_streams(n: int, piddir: Path) -> None:
    proc = popmesh("launch", "-n", str(n), WORKER, "ok", "a", "--flag", env={"POPMESH_TEST_PIDDIR": str(piddir)})
    assert proc.returncode == 0, proc.stderr
    for r in range(n):
        assert f"[rank {r}] hello from {r} args=['a', '--flag']\n" in proc.stdout
        assert f"[rank {r}] err line {r}\n" in proc.stderr
    assert "err line" not in proc.stdout and "hello" not in proc.stderr
    assert len(proc.stdout.splitlines()) == n
    assert_all_gone(_pids(piddir, n), within=1.0)


@pytest.mark.timeout(30)
def test_environment_contract() -> None:
    proc = popmesh("launch", "-n", "3", WORKER, "env", env={"OMP_NUM_THREADS": "7", "MKL_NUM_THREADS": ""})
    assert proc.returncode == 0, proc.stderr
    envs = {int(e["RANK"]): e for e in (json.loads(m) for m in re.findall(r"ENV (.*)", proc.stdout))}
    assert sorted(envs) == [0, 1, 2]
    share = str(thread_share(len(os.sched_getaffinity(0)), 3))
    for r, e in envs.items():
        assert (e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("3", str(r), "3", "0")
        assert (e["MASTER_ADDR"], e["POPMESH_ENGINE"]) == ("127.0.0.1", "torch")
        assert (e["OMP_NUM_THREADS"], e["MKL_NUM_THREADS"]) == ("7", share)
        assert e["POPMESH_PARENT_PID"] is None and e["JAX_COORDINATOR_ADDRESS"] is None
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert envs[0]["POPMESH_STORE_FD"] is not None and envs[1]["POPMESH_STORE_FD"] is None


@pytest.mark.timeout(30)
def test_jax_engine_environment() -> None:
    proc = popmesh("launch", "-n", "2", "--engine", "jax", WORKER, "env")
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads(m) for m in re.findall(r"ENV (.*)", proc.stdout)]
    for e in envs:
        assert e["POPMESH_ENGINE"] == "jax" and e["POPMESH_STORE_FD"] is None
        assert e["JAX_COORDINATOR_ADDRESS"] == f"127.0.0.1:{e['MASTER_PORT']}"
        assert e["JAX_NUM_PROCESSES"] == "2" and e["JAX_PROCESS_ID"] == e["RANK"]
    assert sorted(e["RANK"] for e in envs) == ["0", "1"]


@pytest.mark.timeout(30)
def test_quiet_others_shows_rank_zero_only() -> None:
    proc = popmesh("launch", "-n", "3", "--quiet-others", WORKER, "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[rank 0] hello from 0 args=[]\n"
    launcher_warnings = "popmesh launch: warning:"  # 3 ranks on fewer cores are announced as oversubscribed
    ranks_stderr = [line for line in proc.stderr.splitlines(keepends=True) if not line.startswith(launcher_warnings)]
    assert ranks_stderr == ["[rank 0] err line 0\n"]


@pytest.mark.timeout(30)
def test_module_target_runs_like_python_m() -> None:
    proc = popmesh("launch", "-n", "2", "-m", "launch_worker", "ok", "x", cwd=SCRIPTS)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] hello from 0 args=['x']" in proc.stdout and "[rank 1] hello from 1" in proc.stdout


@pytest.mark.timeout(30)
def test_a_raising_rank_is_named_with_its_traceback(piddir: Path) -> None:
    proc = popmesh("launch", "-n", "3", WORKER, "raise", env={"POPMESH_TEST_PIDDIR": str(piddir)})
    assert proc.returncode == 1
    summary = proc.stderr.split("popmesh launch: FAILED", 1)[1]
    assert "root cause: rank 1 exited with code 1 after raising ValueError: deliberate failure in rank 1" in summary
    assert "in fail_in_rank_one" in summary and "runpy" not in summary
    assert "terminated by the launcher: ranks 0, 2" in summary
    assert_all_gone(_pids(piddir, 3, timeout=0))


@pytest.mark.timeout(30)
def test_a_sigkilled_rank_is_reported_as_such(piddir: Path) -> None:
    proc = popmesh("launch", "-n", "2", WORKER, "sigkill", env={"POPMESH_TEST_PIDDIR": str(piddir)})
    assert proc.returncode == 128 + signal.SIGKILL
    assert "root cause: rank 1 was killed by SIGKILL (exit code 137)" in proc.stderr
    assert_all_gone(_pids(piddir, 2, timeout=0))


@pytest.mark.timeout(30)
def test_a_hanging_rank_is_torn_down_quickly(piddir: Path) -> None:
    proc = popmesh("launch", "-n", "2", WORKER, "hang", env={"POPMESH_TEST_PIDDIR": str(piddir)})
    elapsed = time.time() - float(re.findall(r"FAILING AT (\S+)", proc.stdout)[0])
    assert proc.returncode == 1
    assert elapsed < 5, f"the launcher exited {elapsed:.1f}s after the failure"
    assert "root cause: rank 0 exited with code 1" in proc.stderr
    assert "terminated by the launcher: ranks 1" in proc.stderr
    assert_all_gone(_pids(piddir, 2, timeout=0))


@pytest.fixture
def sleeping_world(piddir: Path):
    """Start ``popmesh launch -n N [options] worker sleep``; whatever the test does, nothing is left."""
    started: list[tuple[subprocess.Popen, list[int]]] = []

    def start(n: int, *options: str) -> tuple[subprocess.Popen, list[int]]:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "popmesh", "launch", "-n", str(n), *options, WORKER, "sleep"],
            # TMPDIR: the error directory of a SIGKILLed launcher is left in pytest's tmp_path
            env={**os.environ, "POPMESH_TEST_PIDDIR": str(piddir), "TMPDIR": str(piddir.parent)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        started.append((launcher, []))
        started[-1] = (launcher, _pids(piddir, n))
        return started[-1]

    yield start
    for launcher, pids in started:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher tears its workers down
            launcher.communicate(timeout=10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("engine", ["torch", pytest.param("mpi", marks=pytest.mark.skipif(not HAS_MPI, reason="MPI"))])
def test_sigkilled_launcher_leaves_no_worker_alive(sleeping_world, engine: str) -> None:
    launcher, pids = sleeping_world(3, "--engine", engine)
    launcher.kill()
    launcher.communicate(timeout=10)
    assert_all_gone(pids)


@pytest.mark.timeout(30)
def test_sigterm_to_launcher_is_forwarded_and_tears_down(sleeping_world) -> None:
    launcher, pids = sleeping_world(2, "--grace", "1")
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=10)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "the launcher received SIGTERM" in err
    assert_all_gone(pids, within=0.5)


@pytest.mark.timeout(60)
def test_torch_gloo_world_through_the_store_socket() -> None:
    proc = popmesh("launch", "-n", "2", str(SCRIPTS / "launch_torch_worker.py"), timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] torch rank 0 sum=3" in proc.stdout and "[rank 1] torch rank 1 sum=3" in proc.stdout


@pytest.mark.timeout(40)
def test_fork_from_a_script_and_from_python_m() -> None:
    run = dict(capture_output=True, text=True, timeout=30, cwd=SCRIPTS)
    script = subprocess.run([sys.executable, "launch_fork.py", "a"], **run)
    assert script.returncode == 0, script.stderr
    assert "[rank 0] CHILD rank=0 args=['a']" in script.stdout and "[rank 1] CHILD rank=1" in script.stdout
    assert script.stdout.rstrip().endswith("PARENT done args=['a']")
    module = subprocess.run([sys.executable, "-m", "launch_fork", "b", "fail"], **run)
    assert module.returncode == 1
    assert "[rank 0] CHILD rank=0 args=['b', 'fail']" in module.stdout and "PARENT" not in module.stdout
    assert "LaunchFailed: launched world failed with exit code 1: rank 1" in module.stderr


@pytest.mark.timeout(30)
def test_bad_configuration_exits_2_with_advice() -> None:
    proc = popmesh("launch", "-n", "2", "--engine", "nccl2", WORKER, "ok")
    assert proc.returncode == 2 and "unknown engine 'nccl2'" in proc.stderr
    proc = popmesh("launch", "--nnodes", "2", "--node-rank", "2", "--master-port", "5", WORKER, "ok")
    assert proc.returncode == 2 and "--node-rank 2 is outside 0..1" in proc.stderr


@pytest.mark.timeout(60)
def test_info_reports_versions_engines_and_env() -> None:
    proc = popmesh("info", "--json", env={"RANK": "5", "POPMESH_X": "y"}, timeout=50)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert set(info["versions"]) == {"python", "popmesh", "torch", "mpi4py", "mpi_library", "jax"}
    assert set(info["engines"]) == {"torch", "mpi", "jax"} and info["engines"]["torch"] is True
    assert info["environment"]["RANK"] == "5" and info["environment"]["POPMESH_X"] == "y"


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_MPI, reason="needs mpi4py and the venv's mpiexec")
def test_mpi_engine_success_and_failure() -> None:
    mpi_worker = str(SCRIPTS / "launch_mpi_worker.py")
    ok = popmesh("launch", "-n", "2", "--engine", "mpi", mpi_worker)
    assert ok.returncode == 0, ok.stderr
    for r in range(2):
        assert f"[rank {r}] mpi rank {r} of 2 engine=mpi sum=3" in ok.stdout
    t0 = time.monotonic()
    bad = popmesh("launch", "-n", "3", "--engine", "mpi", mpi_worker, "raise")
    assert time.monotonic() - t0 < 15
    assert bad.returncode != 0
    assert "root cause: rank 1 exited with code 1 after raising RuntimeError: deliberate MPI failure" in bad.stderr
    assert 'raise RuntimeError("deliberate MPI failure in rank 1")' in bad.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["torch", pytest.param("mpi", marks=pytest.mark.skipif(not HAS_MPI, reason="MPI"))])
def test_a_rank_hanging_in_a_collective_ends_the_world(piddir: Path, engine: str) -> None:
    script = str(SCRIPTS / "launch_collective_hang.py")
    proc = popmesh("launch", "-n", "3", "--engine", engine, script, env={"POPMESH_TEST_PIDDIR": str(piddir)},
                   timeout=80)
    assert proc.returncode != 0
    assert "CommTimeout" in proc.stderr and "ranks [2] did not arrive" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"root cause: rank [01]", proc.stderr), proc.stderr[-3000:]
    assert_all_gone(_pids(piddir, 3, timeout=0))
    if engine == "torch":  # it waited for gloo's copy of the failed collective: until the launcher's teardown
        took = [float(t) for t in re.findall(r"finalized in (\d+\.\d+) s", proc.stdout + proc.stderr)]
        assert took and max(took) < 2.0, (took, proc.stdout[-2000:])
