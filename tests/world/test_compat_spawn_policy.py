"""popmesh.compat.spawn_policy: the seed document's signatures, the worst-ranks helper, and the policies
on real worlds of 1, 2 and 3 ranks (torch; MPI for the one-sided policies).
The training files (population, buffers, compat) share one world per engine and size."""

import inspect
import sys
from pathlib import Path

import pytest

from workers import compat_spawn_policy_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")
sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import facade_mismatches, require_seed

import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError


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
    assert sp._compute_worst_ranks_by_ratio(metrics, 1.5) == {1, 2, 3}  # clamped, as upstream: n - 1
    assert sp._compute_worst_ranks_by_ratio(metrics, -0.5) == {3}
    assert sp._compute_worst_ranks_by_ratio(list(range(10)), 0.29) == {0, 1}  # floor(10 * 0.29) = 2

def test_constructor_arguments_are_checked_and_kept():
    policy = sp.AsyncSelectiveAveragingPolicy(lambda: None, 0, averaging_strategy="best_only", timing={})
    settings = (policy.average_every, policy.averaging_strategy, policy.cooldown, policy.timing)
    assert settings == (1, "best_only", 200, {})
    with pytest.raises(ConfigError):
        sp.AsyncSelectiveAveragingPolicy(lambda: None, 10, averaging_strategy="median")
    with pytest.raises(ConfigError):
        sp.AsyncSelectiveAveragingPolicy(lambda: None, 10, momentum=2.0)


world_run, test_on_a_world, test_world_exits_cleanly = world_tests(
    worker, [("torch", 1), ("torch", 2), ("torch", 3), ("mpi", 1), ("mpi", 2), ("mpi", 3)],
    timeout=240, suite="training",
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_policies_start_the_world_when_nothing_did(engine):
    """Under popmesh launch or mpiexec, with no popmesh.init() in the script (upstream needs none)."""
    import subprocess

    from harness import mpiexec

    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    script = Path(__file__).parent / "scripts" / "spawn_policy_no_init.py"
    done = subprocess.run([sys.executable, "-m", "popmesh", "launch", "-n", "2", "--engine", engine, str(script)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"NOINIT rank={r} size=2 ok" in done.stdout for r in range(2)), done.stdout[-3000:]
