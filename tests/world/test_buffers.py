"""Roles and the replay-buffer service on real worlds of 2, 3 and 4 ranks (torch/gloo; MPI at 4), and
crashes (torch). The training files (population, buffers, compat) share one world per engine and size."""

from pathlib import Path

import pytest

from harness import run_world
from workers import buffers_crash_worker
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
