"""AsyncSelectiveAveraging on real worlds: 1 rank, torch/gloo at 2, 3 and 4 ranks and MPI at 3 ranks,
one pytest item per check; a rank five times slower than the others, and dead or finalized peers, in
worlds of their own.
The training files (population, buffers, compat) share one world per engine and size."""

from pathlib import Path

import pytest

from harness import mpiexec, run_world
from workers import population_async_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("local", 1), ("torch", 2), ("torch", 3), ("torch", 4), ("mpi", 3)], timeout=240, suite="training"
)


@pytest.mark.timeout(120)
def test_dead_peer_is_an_error_not_a_hang():
    from workers import population_async_failure_worker as failure

    run = run_world(Path(failure.__file__), "torch", 3, timeout=90, expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    for rank in (0, 1):
        assert run.outcome("dead_peer_surfaces_at_shutdown")[rank] == "ok", run.output[-3000:]
    assert run.returncodes[2] == 3


@pytest.mark.timeout(120)
def test_dead_donor_is_an_error_on_the_replaced_rank():
    from workers import population_async_failure_worker as failure

    run = run_world(Path(failure.__file__), "torch", 3, timeout=90, env={"POPMESH_TEST_DEAD": "donor"},
                    expect_deaths=True)
    assert not run.timed_out, run.output[-3000:]
    for rank in (0, 2):
        assert run.outcome("dead_donor_surfaces_on_the_replaced_rank")[rank] == "ok", run.output[-3000:]
    assert run.returncodes[1] == 3


@pytest.mark.timeout(120)
def test_peers_finalizing_before_a_late_rank_reads_fin():
    """Regression: a goodbye that overtakes a slow rank's FIN is an orderly end, not a PeerFailure."""
    from workers import population_async_failure_worker as failure

    run = run_world(Path(failure.__file__), "torch", 3, timeout=90, env={"POPMESH_TEST_DEAD": "nobody"})
    assert not run.timed_out, run.output[-3000:]
    assert run.outcome("peers_finalizing_first_is_no_error") == {0: "ok", 1: "ok", 2: "ok"}, run.output[-3000:]
    assert run.returncodes == [0, 0, 0], run.output[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_lost_member_surfaces_while_training(how):
    """No launcher tears the world down here (ranks started directly): the heartbeat finds the loss."""
    from workers import population_async_failure_worker as failure

    run = run_world(Path(failure.__file__), "torch", 3, timeout=60, expect_deaths=True,
                    env={"POPMESH_TEST_DEAD": how, "POPMESH_HEARTBEAT_TIMEOUT": "3"})
    for rank in (0, 1):
        assert run.outcome("lost_member_surfaces_while_training")[rank] == "ok", run.output[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_a_slow_rank_delays_nobody_elses_replacement(engine):
    """4 ranks, the last one five times slower: with the default decide="latest" a fast rank's
    replacement lands within two of its iterations of the report that decided it, while the slow rank
    lags far behind; decide="complete" waits for it."""
    from workers import population_async_slow_worker as slow

    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    run = run_world(Path(slow.__file__), engine, 4, timeout=120)
    assert not run.timed_out, run.output[-3000:]
    for name in ("a_nan_metric_is_refused_naming_the_rank", "slow_rank_does_not_delay_the_others_replacements",
                 "complete_mode_waits_for_the_slow_rank"):
        assert run.outcome(name) == {r: "ok" for r in range(4)}, run.output[-3000:]
    assert set(run.returncodes) == {0}, run.output[-3000:]  # under mpiexec one process is the world


@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine, size", [("torch", 4), ("mpi", 3)])
def test_the_reproducible_mode_gives_bit_identical_runs(engine, size, tmp_path):
    """lag=: two runs whose reports arrive in other orders (random sleeps from the OS) make the same
    replacements at the same iterations and end with the same weights, bit for bit."""
    import json

    from workers import population_async_reproducible_worker as repro

    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpiexec not installed")
    records = []
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        run = run_world(Path(repro.__file__), engine, size, timeout=90, env={"POPMESH_TEST_RECORD": str(out)})
        assert not run.timed_out, run.output[-3000:]
        assert run.outcome("two_runs_with_the_same_seeds_are_bit_identical") == {r: "ok" for r in range(size)}, \
            run.output[-3000:]
        records.append([json.loads((out / f"rank{r}.json").read_text()) for r in range(size)])
    assert records[0] == records[1]
    assert sum(len(r["applied"]) for r in records[0]) >= 2, records[0]
