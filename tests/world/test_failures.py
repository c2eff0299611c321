"""A silent rank becomes a CommTimeout that names it; a dead rank becomes an error, never a hang."""

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
    run = run_world(SCRIPT, "torch", 2, timeout=60, env={"SCENARIO": "dead"})
    assert not run.timed_out, run.output[-3000:]
    assert run.outcome("dead_rank_surfaces")[0] == "ok", run.output[-3000:]
    assert run.returncodes[1] == 3
