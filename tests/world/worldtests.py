"""One world per (engine, size), one pytest item per registered check: the pattern every world-test
file uses, written once.

    world_run, test_check, test_world_exits_cleanly = world_tests(worker, [("torch", 2), ("mpi", 3)])

Files that pass the same ``suite=`` name share their worlds: for each (engine, size) one world runs
the checks of every worker of the suite that asked for that world (in collection order), so a world
starts once per engine and size, not once per file. A failure anywhere in a shared world takes it
down, and the checks that did not run are reported as such in every file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from harness import WorldRun, mpiexec, run_world
from worldlib import checks_of, suite_key

EnvFor = Callable[[str, int], dict]
SUITE_SCRIPT = Path(__file__).parent / "workers" / "suite_worker.py"
_MEMBERS: dict[tuple[str, str, int], list[tuple[ModuleType, float, EnvFor | None]]] = {}  # (suite, engine, size)
_RUNS: dict[tuple[str, str, int], WorldRun] = {}


def world_tests(worker: ModuleType, worlds: list[tuple[str, int]], *, timeout: float = 240,
                env_for: EnvFor | None = None, suite: str | None = None) -> tuple[Callable, Callable, Callable]:
    """The module-scoped world fixture and the two tests over ``worker``'s checks."""
    for engine, size in worlds if suite else ():
        _MEMBERS.setdefault((suite, engine, size), []).append((worker, timeout, env_for))

    def key(name: str) -> str:
        return suite_key(worker.__name__, name) if suite else name

    @pytest.fixture(scope="module", params=worlds, ids=[f"{e}-{n}" for e, n in worlds])
    def world_run(request):
        engine, size = request.param
        if engine == "mpi" and mpiexec() is None:
            pytest.skip("mpiexec not installed")
        if suite:
            run = _suite_run(suite, engine, size)
        else:
            run = run_world(Path(worker.__file__), engine, size, timeout=timeout,
                            env=env_for(engine, size) if env_for else None)
        assert not run.timed_out, f"world timed out:\n{run.output[-4000:]}"
        return run

    @pytest.mark.timeout(timeout + 60)
    @pytest.mark.parametrize("name", checks_of(worker))
    def test_check(world_run, name):
        verdict, why = world_run.verdict(key(name))
        if verdict == "skip":
            pytest.skip(why)
        assert verdict == "pass", f"{why}\n{world_run.output[-3000:]}"

    @pytest.mark.timeout(timeout + 60)
    def test_world_exits_cleanly(world_run):
        if world_run.aborted is not None and world_run.aborted.check is not None:
            pytest.skip(world_run.aborted.reason())  # that check's own test fails
        assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]

    return world_run, test_check, test_world_exits_cleanly


def _suite_run(suite: str, engine: str, size: int) -> WorldRun:
    """The shared world of ``suite`` on ``engine`` at ``size``, run the first time a file asks for it:
    every member's checks, under the longest of their timeouts and all of their environments."""
    key = (suite, engine, size)
    if key not in _RUNS:
        members = _MEMBERS[key]
        env = {"POPMESH_TEST_SUITE": ",".join(m.__name__.rsplit(".", 1)[-1] for m, _, _ in members)}
        for _, _, env_for in members:
            env.update(env_for(engine, size) if env_for else {})
        _RUNS[key] = run_world(SUITE_SCRIPT, engine, size, timeout=max(t for _, t, _ in members), env=env)
    return _RUNS[key]
