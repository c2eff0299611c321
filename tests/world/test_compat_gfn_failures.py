"""A rank that raises takes its world down, whatever launched it, with torchgfn's own replay-buffer
manager and buffers (gfn.containers, from PyPI) on 3 ranks through popmesh.compat.gfn: trainer 0
raises while the buffer rank waits in torchgfn's raw any-source ``dist.recv`` and trainer 1 in a
barrier with it (tests/world/scripts/gfn_buffer_failure.py).

* mpiexec: the failing rank tells its peers and aborts MPI, and mpiexec ends the job;
* torchrun and ``popmesh launch``: the launcher ends the others once rank 0 exits;
* no launcher that ends the job (three processes started by hand, or as srun starts a step's tasks, with
  only Slurm's variables, and under a real ``srun`` where Slurm runs): the peers, told by rank 0, end
  themselves:
  trainer 1's barrier fails at once and names rank 0, and the buffer rank, blocked where popmesh
  cannot interrupt it, is ended within the take-down grace, saying where it was.

Each world must end within seconds of the failure, its output naming rank 0 and its error; a hard
timeout turns a hang into a failure. The hook and the take-down are also checked alone, in single
processes with a stand-in for the heartbeat."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import mpiexec
from ports import port_of, store_env, store_listener

pytestmark = pytest.mark.world
needs_torchgfn = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("gfn") is None,
    reason="torchgfn is not installed: `make test` installs it (the gfn extra, then pip install --no-deps "
           "torchgfn, whose numpy<2 pin popmesh cannot honour)")

SCRIPT = str(Path(__file__).parent / "scripts" / "gfn_buffer_failure.py")
HARD_S = 100  # the whole world, from start to end: past this it hung
LAUNCHER_END_S = 10.0  # from rank 0's failure to the world's end, where a launcher ends the job
TAKE_DOWN_END_S = 15.0  # the same without a launcher: the take-down grace (5 s) and the exits
FAILED = "popmesh: rank 0 failed (ValueError: trainer 0 gives up)"


def _env() -> dict[str, str]:
    """This environment without any launcher's variables (the test is not inside a launch)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "TORCHELASTIC_", "POPMESH_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", POPMESH_TIMEOUT="120")  # gloo's own timeout cannot end the world in time
    return env


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> tuple[float, list[int], str]:
    """(wall clock when the last process ended, exit codes, output); every process group is killed and
    the test fails if the world outlives HARD_S."""
    deadline = time.monotonic() + HARD_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.time()
    hung = [p for p in procs if p.poll() is None]
    for p in hung:
        os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    assert not hung, f"the world hung: still running after {HARD_S} s\n{output[-4000:]}"
    return ended, [p.returncode for p in procs], output


def _launch(cmd: list[str], log: Path) -> tuple[float, list[int], str]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return _wait([proc], [log])


def _started_as(starter: str, rank: int, port: int) -> dict[str, str]:
    """What a rank's environment holds, besides the store: torch's variables for a start by hand, only
    srun's for a task of a Slurm step (one node; srun keeps the other tasks running when one fails,
    unless told --kill-on-bad-exit)."""
    if starter == "by hand":
        return {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0",
            "SLURM_LOCALID": str(rank), "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_TASKS_PER_NODE": "3", "SLURM_NNODES": "1", "MASTER_PORT": str(port)}


def _by_hand(tmp_path: Path, starter: str = "by hand") -> tuple[float, list[int], str]:
    """Three ranks started as plain `python script.py` (``starter``: "by hand" with torch's variables,
    "srun" with a Slurm task's): nobody ends the job."""
    procs, logs = [], []
    with store_listener() as listener:
        for rank in range(3):
            env = dict(_env(), **_started_as(starter, rank, port_of(listener)),
                       **(store_env(listener) if rank == 0 else {}))
            logs.append(tmp_path / f"rank{rank}.log")
            fds = (listener.fileno(),) if rank == 0 else ()
            with open(logs[-1], "wb") as out:
                procs.append(subprocess.Popen([sys.executable, SCRIPT], env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, pass_fds=fds))
    return _wait(procs, logs)


def _failed_at(output: str, codes: list[int]) -> float:
    found = re.search(r"FAILING t=([\d.]+)", output)
    assert found is not None, f"rank 0 never reached its failure (exit codes {codes}):\n{output[-4000:]}"
    return float(found.group(1))


@needs_torchgfn
@pytest.mark.timeout(HARD_S + 20)
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun", "popmesh launch"])
def test_a_failing_trainer_ends_the_world_under_a_launcher(launcher: str, tmp_path: Path) -> None:
    if launcher == "mpiexec":
        if mpiexec() is None:
            pytest.skip("mpiexec not installed (pip install mpi4py mpich)")
        cmd = [str(mpiexec()), "-n", "3", sys.executable, SCRIPT]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", SCRIPT]
    else:
        cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "3", SCRIPT]
    ended, codes, output = _launch(cmd, tmp_path / "world.log")
    seconds = ended - _failed_at(output, codes)
    print(f"{launcher}: the world ended {seconds:.2f} s after rank 0 failed")
    assert seconds < LAUNCHER_END_S and codes != [0], (seconds, codes, output[-4000:])
    assert output.count("READY rank=") == 3 and "backend=gloo" in output, output[-4000:]
    if launcher == "popmesh launch":  # its bootstrap reports the failure; the launcher names the root cause
        assert "root cause: rank 0 exited with code 1 after raising ValueError: trainer 0 gives up" in output, output
        return
    assert FAILED in output, output[-4000:]  # its own words, whichever rank the launcher saw end first
    if launcher == "mpiexec":
        assert f"{FAILED}, and its world goes down with it: its peers are told, MPI is aborted" in output, output


@needs_torchgfn
@pytest.mark.timeout(HARD_S + 20)
@pytest.mark.parametrize("starter", ["by hand", "srun"])
def test_without_a_launcher_the_peers_end_themselves(starter: str, tmp_path: Path) -> None:
    ended, codes, output = _by_hand(tmp_path, starter)
    seconds = ended - _failed_at(output, codes)
    print(f"{starter}: the world ended {seconds:.2f} s after rank 0 failed")
    assert seconds < TAKE_DOWN_END_S and codes == [1, 1, 1], (seconds, codes, output[-4000:])
    assert FAILED in output, output[-4000:]
    assert "popmesh: before this error, rank(s) [0] of this world had failed: rank 0 failed: ValueError: " \
           "trainer 0 gives up" in output, output[-4000:]  # trainer 1, released from its barrier
    taken_down = output[output.index("rank 2 was still running"):]  # the buffer rank, blocked in torchgfn's recv
    assert "popmesh: rank 0 failed (ValueError: trainer 0 gives up), and a rank that fails takes its world down; " \
           "rank 2 was still running" in output, output[-4000:]
    assert "replay_buffer_manager.py" in taken_down and "dist.recv(" in taken_down, taken_down
    assert "popmesh: ending rank 2 (exit status 1)" in taken_down, taken_down


def _slurm_answers() -> bool:
    """Whether srun is installed and a Slurm controller answers (sinfo within 10 s)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@needs_torchgfn
@pytest.mark.timeout(HARD_S + 20)
def test_under_a_real_srun_the_world_ends_when_a_rank_fails(tmp_path: Path) -> None:
    """``srun -n 3`` itself (Slurm's step launcher, which keeps the other tasks running when one fails
    unless told ``--kill-on-bad-exit``): the world forms from Slurm's variables alone, and the peers
    of the failed rank end themselves."""
    if not _slurm_answers():
        pytest.skip("no Slurm here: srun is not installed or no controller answers (sinfo)")
    cmd = ["srun", "-n", "3", "--overcommit", "--kill-on-bad-exit=0", sys.executable, SCRIPT]
    ended, codes, output = _launch(cmd, tmp_path / "world.log")
    seconds = ended - _failed_at(output, codes)
    print(f"srun: the world ended {seconds:.2f} s after rank 0 failed")
    assert seconds < TAKE_DOWN_END_S and codes == [1], (seconds, codes, output[-4000:])
    assert output.count("READY rank=") == 3 and "backend=gloo" in output, output[-4000:]
    assert FAILED in output and "popmesh: ending rank 2 (exit status 1)" in output, output[-4000:]
    assert all(f"task {t}: Exited with exit code 1" in output for t in range(3)), output[-4000:]


PEERS = """\
import sys, threading, time
from popmesh.core.errors import PeerFailure
from popmesh.engines import failing

class Peers:  # what a running heartbeat offers the hook
    rank = 5
    def announce_failing(self, text):
        print("ANNOUNCED " + text, flush=True)
    def errors(self):
        return {0: PeerFailure("rank 0 failed: ValueError: first", (0,))} if "after" in sys.argv else {}

failing.register(Peers())
"""


def _alone(tmp_path: Path, code: str, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    script = tmp_path / "alone.py"
    script.write_text(PEERS + code)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=30,
                          env=_env())
    return time.monotonic() - start, done


@pytest.mark.timeout(60)
def test_the_hook_tells_the_peers_and_names_what_failed_before(tmp_path: Path) -> None:
    _, done = _alone(tmp_path, 'raise ValueError("trainer 5 gives up")')
    assert done.returncode == 1 and "ValueError: trainer 5 gives up" in done.stderr, done.stderr
    assert "popmesh: rank 5 failed (ValueError: trainer 5 gives up), and its world goes down with it: its peers " \
           "are told" in done.stderr, done.stderr
    assert "ANNOUNCED ValueError: trainer 5 gives up" in done.stdout and "before this error" not in done.stderr
    _, done = _alone(tmp_path, 'raise RuntimeError("Connection closed by peer [127.0.0.1]:4711")', "after")
    assert "popmesh: before this error, rank(s) [0] of this world had failed: rank 0 failed: ValueError: first" \
           in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_failing_rank_whose_exit_stalls_is_ended(tmp_path: Path) -> None:
    seconds, done = _alone(tmp_path, 'threading.Thread(target=time.sleep, args=(60,)).start()\nraise ValueError("x")')
    assert done.returncode == 1 and seconds < 20, (seconds, done.stderr)
    assert "popmesh: rank 5's exit stalled 5 s after its uncaught exception" in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_peer_told_of_a_failure_ends_where_it_waits(tmp_path: Path) -> None:
    code = ('threading.Timer(0.2, failing.take_down, args=(2, 0, "ValueError: trainer 0 gives up", 0.5)).start()\n'
            'time.sleep(30)  # a wait popmesh cannot interrupt\n')
    seconds, done = _alone(tmp_path, code)
    assert done.returncode == 1 and seconds < 10, (seconds, done.stderr)
    assert "popmesh: rank 0 failed (ValueError: trainer 0 gives up), and a rank that fails takes its world down; " \
           "rank 2 was still running 0.5 s later" in done.stderr, done.stderr
    assert "time.sleep(30)  # a wait popmesh cannot interrupt" in done.stderr, done.stderr
    assert "popmesh: ending rank 2 (exit status 1)" in done.stderr
