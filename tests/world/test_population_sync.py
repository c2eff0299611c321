"""Synchronous population policies (AverageAll, SelectiveAveraging) on real worlds: 1 rank, torch/gloo
at 4 ranks and MPI at 3 ranks, one world per engine and size, one pytest item per check."""

from pathlib import Path

import pytest

from harness import mpiexec, run_world
from worldlib import checks_of
from workers import population_sync_worker as worker

SCRIPT = Path(worker.__file__)
WORLDS = [("local", 1), ("torch", 4), ("mpi", 3)]


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
def test_check(world_run, name):
    failures = {r: o for r, o in world_run.outcome(name).items() if o != "ok"}
    assert not failures, f"{name} on {world_run.engine}-{world_run.size}: {failures}\n{world_run.output[-3000:]}"


@pytest.mark.timeout(300)
def test_world_exits_cleanly(world_run):
    assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]
