"""`popmesh launch --engine mpi` watches its ranks: a rank of any script (popmesh imported or not)
that raises, exits non-zero or is killed takes the world down within seconds; the root cause names
the rank that raised, exited or was killed (mpiexec itself gives only its own exit code). A killed
rank leaves no record: the launcher names it from its watch of the ranks' end pipes and pids
(popmesh.launch.rankwatch), exactly where the kernel releases a dying process's files highest first.

A rank that fails before MPI starts (an import error, an argument error, a missing file), which Hydra does
not act on, is seen by its exit note: the launcher ends the job within seconds of the failure, names the
rank with its own exit code, and leaves none of the world's processes (ranks, Hydra's proxies, mpiexec)
behind, on one host and across two (network-namespace hosts, tests/world/hosts.py)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import mpiexec
from hosts import TwoHosts, unavailable
from popmesh.launch.rankwatch import releases_highest_first

SCRIPT = Path(__file__).parent / "scripts" / "mpi_rank_fails.py"
EARLY = Path(__file__).parent / "scripts" / "mpi_fails_early.py"
TEARDOWN_LIMIT_S = 10  # from the failure to the launcher's end: 0.03-0.45 s measured; slack for a loaded 2-core box
_FAILING = re.compile(r"FAILING AT (\d+\.\d+)")
_STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE", "HYDRA_IFACE")


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


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STALE and not k.startswith(("PMI_", "SLURM_"))}
    return {**env, **extra}


def _alive(pid: int, started: str) -> bool:
    """Whether ``pid`` still runs as the process that recorded ``started`` (a zombie counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == started and fields[0] != "Z"


def _assert_none_left(folder: Path, ranks: int, within: float = 2.0) -> None:
    """Every process the ranks recorded (the ranks, Hydra's proxies, mpiexec, the shells between) is gone."""
    recorded = sorted(folder.glob("rank-*.procs"))
    assert len(recorded) == ranks, [p.name for p in recorded]
    procs = {(int(pid), started) for path in recorded for pid, started in map(str.split, path.read_text().splitlines())}
    deadline = time.monotonic() + within
    while any(_alive(*proc) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(pid for pid, started in procs if _alive(pid, started))
    for pid in left:  # clean up before failing, so a defect does not leave processes behind
        os.kill(pid, 9)
    assert not left, f"processes of the world outlived the launch: {left}"


def _teardown_s(said: str, ended_at: float, record_property) -> float:
    """Seconds from the failing rank's failure (its FAILING AT line) to the launcher's end, recorded."""
    failed_at = _FAILING.search(said)
    assert failed_at is not None, said[-3000:]
    took = ended_at - float(failed_at[1])
    record_property("teardown_s", round(took, 3))
    print(f"teardown {took:.3f} s after the failure")
    return took


EARLY_CAUSES = {
    "import": ("root cause: rank 1 exited with code 1 after raising ModuleNotFoundError: "
               "No module named 'popmesh_no_such_module'", 1),
    "args": ("root cause: rank 1 exited with code 2, on host", 2),
    "missing-file": ("root cause: rank 1 exited with code 1 after raising FileNotFoundError: [Errno 2] "
                     "No such file or directory", 1),
    "kill": ("root cause: rank 1 was killed by SIGKILL (exit code 137)", 137),
}


@pytest.mark.timeout(60)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
@pytest.mark.parametrize("how", list(EARLY_CAUSES))
def test_a_rank_failing_before_mpi_starts_ends_the_world_within_seconds(how, tmp_path, record_property):
    """Rank 1 of 3 fails before MPI starts (while the others wait in MPI_Init or sleep without MPI): the
    launch ends within seconds of the failure with rank 1's own exit code, and no process is left. Hydra
    ends the job itself for a signal (``kill``); for an exit code, the launcher ends it."""
    host = os.uname().nodename
    for rank in (0, 2):
        (tmp_path / f"{host}-rank{rank}.cfg").write_text("steps=1\n")
    done = subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", "3", "--engine", "mpi", str(EARLY), how,
                           str(tmp_path)], capture_output=True, text=True, timeout=30, env=_env())
    ended_at = time.time()
    said = done.stdout + done.stderr
    cause, code = EARLY_CAUSES[how]
    assert done.returncode == code and cause in done.stderr, said[-3000:]
    if how == "args":
        assert "train: error: unrecognized arguments: --lr 3e-4" in done.stderr.split("root cause:")[1], said[-3000:]
    assert "code 15" not in done.stderr.split("root cause:")[1], said[-3000:]  # not the teardown's SIGTERM
    assert _teardown_s(said, ended_at, record_property) < TEARDOWN_LIMIT_S
    _assert_none_left(tmp_path, 3)


@pytest.mark.timeout(120)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
@pytest.mark.parametrize("how", ["missing-file", "args"])
def test_a_rank_failing_before_mpi_starts_on_another_host_ends_the_world_there_too(how, tmp_path, record_property):
    """One mpiexec on host a, two ranks there and one on host b (Hydra reaches b through an ssh stand-in).
    ``missing-file``: the file is there on host a only, so rank 2 on host b fails; ``args``: rank 1 on host
    a fails, and rank 2 on host b must be ended with the rest. The launch ends within seconds of the
    failure with the failing rank's own code, and no process is left on either host."""
    with TwoHosts(names="own-loopback") as th:
        a, b = th.hosts
        for rank in (0, 1):
            (tmp_path / f"{a.name}-rank{rank}.cfg").write_text("steps=1\n")
        standin = th.ssh_standin(tmp_path / "ssh")
        proc = a.start([sys.executable, "-m", "popmesh", "launch", "--engine", "mpi", "--hosts",
                        f"{a.name}:2,{b.name}:1", str(EARLY), how, str(tmp_path)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                       env=_env(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(standin)))
        try:
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
        ended_at = time.time()
        said = out + err
        if how == "missing-file":
            cause = (f"root cause: rank 2 exited with code 1 after raising FileNotFoundError: [Errno 2] No such file "
                     f"or directory: '{tmp_path / f'{b.name}-rank2.cfg'}', on host {b.name}")
            code = 1
        else:
            cause, code = f"root cause: rank 1 exited with code 2, on host {a.name}", 2
        assert proc.returncode == code and cause in err, said[-3000:]
        assert _teardown_s(said, ended_at, record_property) < TEARDOWN_LIMIT_S
        _assert_none_left(tmp_path, 3)
