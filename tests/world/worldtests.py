"""One world per (engine, size), one pytest item per registered check: the pattern every world-test
file uses, written once.

    world_run, test_check, test_world_exits_cleanly = world_tests(worker, [("torch", 2), ("mpi", 3)])
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from harness import mpiexec, run_world
from worldlib import checks_of

EnvFor = Callable[[str, int], dict]


def world_tests(worker: ModuleType, worlds: list[tuple[str, int]], *, timeout: float = 240,
                env_for: EnvFor | None = None) -> tuple[Callable, Callable, Callable]:
    """The module-scoped world fixture and the two tests over ``worker``'s checks."""
    script = Path(worker.__file__)

    @pytest.fixture(scope="module", params=worlds, ids=[f"{e}-{n}" for e, n in worlds])
    def world_run(request):
        engine, size = request.param
        if engine == "mpi" and mpiexec() is None:
            pytest.skip("mpiexec not installed")
        run = run_world(script, engine, size, timeout=timeout, env=env_for(engine, size) if env_for else None)
        assert not run.timed_out, f"world timed out:\n{run.output[-4000:]}"
        return run

    @pytest.mark.timeout(timeout + 60)
    @pytest.mark.parametrize("name", checks_of(worker))
    def test_check(world_run, name):
        failures = {r: o for r, o in world_run.outcome(name).items() if o != "ok"}
        assert not failures, f"{name} on {world_run.engine}-{world_run.size}: {failures}\n{world_run.output[-3000:]}"

    @pytest.mark.timeout(timeout + 60)
    def test_world_exits_cleanly(world_run):
        assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]

    return world_run, test_check, test_world_exits_cleanly
