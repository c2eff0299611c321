"""Roles and the replay-buffer service on real worlds of 2, 3 and 4 ranks (torch/gloo; MPI at 4), and
crashes (torch). The training files (population, buffers, compat) share one world per engine and size."""

from pathlib import Path

import pytest

from harness import run_world
from workers import buffers_crash_worker, buffers_lost_agent_worker
from workers import buffers_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("torch", 2), ("torch", 3), ("torch", 4), ("mpi", 4)], timeout=240, suite="training"
)


@pytest.mark.timeout(120)
def test_dead_manager_and_coordinator_are_errors_not_hangs():
    run = run_world(Path(buffers_crash_worker.__file__), "torch", 3, timeout=90, expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    assert run.outcome("dead_service_ranks_surface_as_errors")[0] == "ok", run.output[-3000:]
    assert run.returncodes == [0, 3, 3], (run.returncodes, run.output[-3000:])


@pytest.mark.timeout(90)
def test_a_lost_agent_leaves_the_manager_serving_the_others():
    run = run_world(Path(buffers_lost_agent_worker.__file__), "torch", 3, timeout=60, expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    outcome = run.outcome("a_lost_agent_is_a_hole_the_manager_serves_around")
    assert sorted(run.returncodes) == [0, 0, 3], (run.returncodes, run.output[-3000:])
    assert [outcome[r] for r in range(3) if run.returncodes[r] == 0] == ["ok", "ok"], run.output[-3000:]
    assert "MANAGER" in run.output, run.output[-3000:]
