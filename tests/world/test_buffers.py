"""Roles and the replay-buffer service on real 4-rank worlds (torch/gloo and MPI), and crashes (torch)."""

from pathlib import Path

import pytest

from harness import mpiexec, run_world
from worldlib import checks_of
from workers import buffers_crash_worker, buffers_worker as worker

SCRIPT = Path(worker.__file__)
WORLDS = [("torch", 4), ("mpi", 4)]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{e}-{n}" for e, n in WORLDS])
def world_run(request):
    engine, size = request.param
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    run = run_world(SCRIPT, engine, size, timeout=240)
    assert not run.timed_out, f"world timed out:\n{run.output[-4000:]}"
    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", checks_of(worker))
def test_service(world_run, name):
    outcome = world_run.outcome(name)
    failures = {r: o for r, o in outcome.items() if o != "ok"}
    assert not failures, f"{name} on {world_run.engine}-{world_run.size}: {failures}\n{world_run.output[-3000:]}"


@pytest.mark.timeout(300)
def test_world_exits_cleanly(world_run):
    assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]


@pytest.mark.timeout(120)
def test_dead_manager_and_coordinator_are_errors_not_hangs():
    run = run_world(Path(buffers_crash_worker.__file__), "torch", 3, timeout=90)
    assert not run.timed_out, run.output[-3000:]
    assert run.outcome("dead_service_ranks_surface_as_errors")[0] == "ok", run.output[-3000:]
    assert run.returncodes == [0, 3, 3], (run.returncodes, run.output[-3000:])
