"""popmesh.compat.spawn_policy: the seed document's signatures, the worst-ranks helper, and the policies
on real 2-rank worlds (torch; MPI for the one-sided policies)."""

import inspect
import sys
from pathlib import Path

import pytest

from harness import mpiexec, run_world
from worldlib import checks_of
from workers import compat_spawn_policy_worker as worker

pytest.importorskip("torch")
sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import facade_mismatches, require_seed  # noqa: E402

import popmesh.compat.spawn_policy as sp  # noqa: E402
from popmesh import ConfigError  # noqa: E402


def test_facade_matches_the_seed_document():
    # The seed's group defaults, dist.group.WORLD and MPI.COMM_WORLD, are matched by name: the facade
    # binds sentinels named WORLD / COMM_WORLD meaning "the current world" (no engine at import).
    seed = require_seed("spawn_policy")
    assert facade_mismatches(sp, seed) == []
    defaults = {inspect.signature(sp.AverageAllPolicy.__call__).parameters["group"].default.__name__,
                inspect.signature(sp.AverageAllPolicympi4py.__call__).parameters["group"].default.__name__}
    assert defaults == {"WORLD", "COMM_WORLD"}


def test_spawn_policy_is_abstract():
    with pytest.raises(TypeError):
        sp.SpawnPolicy(1)


def test_compute_worst_ranks_by_ratio():
    metrics = [3.0, 1.0, 2.0, 0.5]
    assert sp._compute_worst_ranks_by_ratio(metrics, 0.5) == {1, 3}
    assert sp._compute_worst_ranks_by_ratio(metrics, 0.0) == {3}  # ratio 0 still replaces one rank
    assert sp._compute_worst_ranks_by_ratio(metrics, 1.0) == {1, 2, 3}  # ratio 1 keeps one rank
    assert sp._compute_worst_ranks_by_ratio([1.0], 0.5) == set()
    assert sp._compute_worst_ranks_by_ratio([2.0, float("nan"), 1.0], 0.34) == {1}  # NaN is worst
    with pytest.raises(ConfigError):
        sp._compute_worst_ranks_by_ratio(metrics, 1.5)


def test_constructor_arguments_are_checked_and_kept():
    policy = sp.AsyncSelectiveAveragingPolicy(lambda: None, 0, averaging_strategy="best_only", timing={})
    assert (policy.average_every, policy.averaging_strategy, policy.cooldown, policy.timing) == (1, "best_only", 200, {})
    with pytest.raises(ConfigError):
        sp.AsyncSelectiveAveragingPolicy(lambda: None, 10, averaging_strategy="median")
    with pytest.raises(ConfigError):
        sp.AsyncSelectiveAveragingPolicy(lambda: None, 10, momentum=2.0)


WORLDS = [("torch", 2), ("mpi", 2)]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{e}-{n}" for e, n in WORLDS])
def world_run(request):
    engine, size = request.param
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    run = run_world(Path(worker.__file__), engine, size, timeout=100)
    assert not run.timed_out, f"world timed out:\n{run.output[-4000:]}"
    return run


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", checks_of(worker))
def test_on_two_ranks(world_run, name):
    failures = {r: o for r, o in world_run.outcome(name).items() if o != "ok"}
    assert not failures, f"{name} on {world_run.engine}: {failures}\n{world_run.output[-3000:]}"


@pytest.mark.timeout(150)
def test_world_exits_cleanly(world_run):
    assert world_run.returncodes == [0] * len(world_run.returncodes), world_run.output[-3000:]
