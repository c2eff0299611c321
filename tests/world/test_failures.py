"""A silent rank becomes a CommTimeout that names it; a dead rank becomes an error, never a hang; and the
harness takes a world down as soon as one of its ranks fails."""

import time
from pathlib import Path

import pytest

from harness import mpiexec, run_world
from workers import failure_worker

SCRIPT = Path(failure_worker.__file__)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_silent_rank_named_in_timeout(engine):
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    run = run_world(SCRIPT, engine, 3, timeout=60, env={"SCENARIO": "late"})
    assert not run.timed_out, run.output[-3000:]
    for rank in (0, 1):
        assert run.outcome("silent_rank_is_named")[rank] == "ok", run.output[-3000:]


@pytest.mark.timeout(90)
def test_dead_rank_is_an_error_not_a_hang():
    run = run_world(SCRIPT, "torch", 2, timeout=60, env={"SCENARIO": "dead"}, expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    assert run.outcome("dead_rank_surfaces")[0] == "ok", run.output[-3000:]
    assert run.returncodes[1] == 3


@pytest.mark.timeout(90)
def test_a_collective_names_the_dead_rank():
    """gloo says only "Connection closed by peer [address]"; the survivors' PeerFailure names rank 1."""
    run = run_world(SCRIPT, "torch", 3, timeout=60, env={"SCENARIO": "dead-middle"}, expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    outcome = run.outcome("dead_rank_is_named_by_collectives")
    assert outcome[0] == outcome[2] == "ok", (outcome, run.output[-3000:])
    assert run.returncodes == [0, 3, 0], (run.returncodes, run.output[-3000:])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("engine", "scenario"), [("torch", "fail"), ("mpi", "fail"), ("torch", "crash")])
def test_a_failing_rank_takes_the_world_down_at_once(engine, scenario, tmp_path):
    """The harness itself: a check failing (or a rank dying) on rank 1 while ranks 0 and 2 wait in a
    barrier ends the world within seconds, names the rank and the error, and reports the later check
    as not run (not as a 30 s timeout); no process of the world is left. (Under mpiexec a dying rank
    takes its world down by itself.)"""
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    start = time.monotonic()
    run = run_world(SCRIPT, engine, 3, timeout=60, env={"SCENARIO": scenario, "POPMESH_TEST_PIDDIR": str(tmp_path)})
    elapsed = time.monotonic() - start
    assert not run.timed_out and elapsed < 15, (elapsed, run.output[-3000:])
    assert run.aborted is not None and (run.aborted.rank, run.aborted.check) == (1, "one_rank_fails_while_peers_wait")
    verdict, why = run.verdict("one_rank_fails_while_peers_wait")
    error = "AssertionError: deliberate failure on rank 1" if scenario == "fail" else "rank 1 exited with code 7"
    assert verdict == "fail" and f"rank 1: {error}" in why, why
    if (engine, scenario) == ("torch", "fail"):  # (a death, the others may see before the harness does)
        assert "rank 0: taken down while running it" in why and "rank 2: taken down while running it" in why, why
    verdict, why = run.verdict("after_the_failure")
    assert verdict == "skip" and why.startswith("not run: the world was taken down after check "
                                                f"one_rank_fails_while_peers_wait failed on rank 1: {error}"), why
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "a process of the world survived the harness"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


FROZEN = Path(__file__).parent / "scripts" / "frozen_rank.py"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine,how,where", [
    ("torch", "freeze", "collective"), ("torch", "freeze", "group"), ("torch", "freeze", "recv"),
    ("torch", "die", "collective"), ("mpi", "freeze", "collective"), ("mpi", "freeze", "recv"),
])
def test_heartbeat_finds_a_frozen_or_dead_rank_whatever_the_operation_timeout(engine, how, where):
    """The last rank is SIGSTOPped (or SIGKILLed, with no launcher to tear the world down) while the
    others wait on it with a 300 s timeout; the heartbeat (3 s here, 20 s by default) ends their
    waits with a PeerFailure naming it."""
    run = run_world(FROZEN, engine, 3, timeout=20, expect_deaths=True,
                    env={"POPMESH_HEARTBEAT_TIMEOUT": "3", "POPMESH_TEST_FROZEN": f"{how} {where}"})
    for rank in (0, 1):
        line = next((x for x in run.output.splitlines() if f"rank {rank} DETECTED" in x), None)
        assert line is not None, run.output[-3000:]
        assert "ranks=[2]" in line and ("rank 2" in line or "rank(s) [2]" in line), line
        seconds = float(line.split(" after ")[1].split(" s")[0])
        assert seconds < 10, line
