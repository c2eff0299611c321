"""popmesh.torch model sync on real worlds: local (1 rank), torch/gloo and MPI at 2 and 3 ranks."""

from pathlib import Path

import pytest

from harness import mpiexec, run_world
from worldlib import checks_of
from workers import torch_sync_worker as worker

pytest.importorskip("torch")

SCRIPT = Path(worker.__file__)
WORLDS = [("local", 1), ("torch", 2), ("torch", 3), ("mpi", 2), ("mpi", 3)]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{e}-{n}" for e, n in WORLDS])
def world_run(request):
    engine, size = request.param
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    run = run_world(SCRIPT, engine, size, timeout=180)
    assert not run.timed_out, f"world timed out:\n{run.output[-4000:]}"
    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", checks_of(worker))
def test_torch_sync(world_run, name):
    outcome = world_run.outcome(name)
    failures = {r: o for r, o in outcome.items() if o != "ok"}
    assert not failures, f"{name} on {world_run.engine}-{world_run.size}: {failures}\n{world_run.output[-3000:]}"


@pytest.mark.timeout(240)
def test_world_exits_cleanly(world_run):
    assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]
