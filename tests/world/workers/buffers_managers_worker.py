"""Two replay-buffer managers and a coordinator, from the torchgfn facade's context: 5 ranks, the managers
placed from the ranks' host names (torch: ``initialize_distributed_compute("gloo", ...)``; MPI: the mpi4py
context from a ``RankLayout.from_hostnames`` passed in). On one host: trainers 0 and 2, managers 1 and 3,
coordinator 4; over two hosts placed cyclically (a, b, a, b, a): trainers 0 (a) and 1 (b), managers 2 (a)
and 3 (b), coordinator 4.

Baselines (``ema`` of batch minima, combined by the coordinator's ``mean``): the first trainer's batches have
the minimum -2, the second's -6, so the global baseline is -4 while those batches go on. Both trainers filter
their next batch by it: the first keeps a -3 row that its manager's own baseline (-2) would drop, the second
drops a -5 row that its own (-6) would keep. The second trainer's report reaches the coordinator first (it
waits for the global -6), so the global baseline only moves -6 then -4 and no batch of constant minimum is
ever cut.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh.buffers import Coordinator, ReplayBufferClient, ReplayBufferManager, novelty_score
from popmesh.compat import gfn
from worldlib import check, main

CTX = {}
LOW = {0: -2.0, 1: -6.0}  # the minimum of each trainer's (first, second) batches


def expected_roles(hostnames):
    """(trainers, {manager: its trainers}, coordinator) of the two placements this file runs."""
    if len(set(hostnames)) == 1:
        return [0, 2], {1: [0], 3: [2]}, 4
    return [0, 1], {2: [0], 3: [1]}, 4


def batch(rank, rewards, k):
    """Rows near 100 * rank (batch k shifted by k), one per reward."""
    states = [[100.0 * rank + k + i, 0.0] for i in range(len(rewards))]
    return {"states": np.asarray(states, np.float32), "log_rewards": np.asarray(rewards, np.float64)}


def wait_for(what, check_once, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check_once()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.05)


@check
def context_places_each_manager_with_its_trainers(w):
    layout = gfn.RankLayout.from_hostnames(w.size, 2, 1, 1, w.hostnames)
    if w.engine_name == "mpi":
        ctx = gfn.initialize_distributed_compute_mpi4py(num_remote_buffers=2, num_coordinators=1, layout=layout)
    else:
        ctx = gfn.initialize_distributed_compute("gloo", num_remote_buffers=2, use_coordinator=True)
    CTX.update(ctx=ctx, backend="mpi" if w.engine_name == "mpi" else "torch")
    trainers, managers, coordinator = expected_roles(w.hostnames)
    r = w.rank
    assert ctx.training_ranks == trainers and ctx.buffer_rank_set == set(managers)
    assert ctx.coordinator_rank == coordinator and ctx.num_training_ranks == 2 and ctx.agent_group_size == 2
    assert (ctx.is_training_rank(), ctx.is_buffer_rank(), ctx.is_coordinator_rank()) == (
        r in trainers, r in managers, r == coordinator)
    if r in trainers:
        assert w.hostnames[ctx.assigned_buffer] == w.hostnames[r]
    if r in managers:
        assert ctx.assigned_training_ranks == managers[r]
        assert {w.hostnames[a] for a in ctx.assigned_training_ranks} == {w.hostnames[r]}
    assert ctx.layout == layout.native and layout.buffer_ranks == sorted(managers)  # the same from the host names


def trainer(w, ctx):
    """Data in (filtered by the global baseline), metadata out; the trainer's index among the two."""
    me = ctx.training_ranks.index(w.rank)
    low = LOW[me]
    client = ReplayBufferClient.from_context(ctx, capacity=64, mode="sync", baseline_filtering=True)
    if me == 0:  # after the second trainer's report reached the coordinator
        gfn.barrier(backend=CTX["backend"], group=ctx.train_global_group)
    first = client.add(batch(w.rank, [low, 0.0], 0))
    assert first["rows"] == 2, first
    if me == 1:
        assert client.baseline == low  # nothing synced yet: its manager's own EMA
        wait_for("the global baseline -6", lambda: client.population_stats()["global_baseline"] == low or None)
        gfn.barrier(backend=CTX["backend"], group=ctx.train_global_group)
    wait_for("the global baseline -4", lambda: client.population_stats()["global_baseline"] == -4.0 or None)
    k = 1
    while client.baseline != -4.0:  # batches of the same minimum until the manager's reply carries it
        reply = client.add(batch(w.rank, [low, 0.0], k))
        assert reply["rows"] == 2 and reply["baseline"] in (low, -6.0, -4.0), reply
        assert k < 200, "the manager never adopted the global baseline"
        k += 1
    gfn.barrier(backend=CTX["backend"], group=ctx.train_global_group)  # both filter by -4 from here on
    filtered = client.add(batch(w.rank, [-3.0, -1.0, -5.0] if me == 0 else [-5.0, -3.0, -7.0], 99))
    assert filtered["rows"] == (2 if me == 0 else 1), filtered  # their own baselines: 1 and 2 rows
    meta = client.get_metadata()
    assert meta["stored"] == 2 * k + filtered["rows"] and meta["capacity"] == 64, meta
    assert -4.1 < meta["baseline"] < -3.8, meta
    client.drain()
    return {"rows": meta["stored"]}


@check
def two_managers_reach_one_global_baseline_and_trainers_filter_by_it(w):
    ctx = CTX["ctx"]
    if ctx.is_buffer_rank():
        manager = ReplayBufferManager.from_context(ctx, capacity=64, scoring_function=novelty_score("states"),
                                                   baseline_strategy="ema")
        stats = manager.run(idle_timeout=60)
        assert manager.done and stats.errors == 0 and set(stats.rows_from) == set(ctx.assigned_training_ranks)
        result = {"synced": manager._synced, "local": manager.local_baseline, "stored": len(manager.store)}
    elif ctx.is_coordinator_rank():
        final = Coordinator.from_context(ctx, baseline_reduce="mean").run(idle_timeout=60)
        assert final["active_managers"] == [] and sorted(final["manager_baselines"]) == sorted(
            str(m) for m in ctx.buffer_rank_set), final
        result = {"global": final["global_baseline"]}
    else:
        result = trainer(w, ctx)
    everyone = popmesh.all_gather_object(result)
    for m in ctx.buffer_rank_set:  # each adopted a global baseline unlike its own
        served = everyone[ctx.layout.assigned_training_ranks(m)[0]]
        assert -4.1 < everyone[m]["synced"] < -3.8 and everyone[m]["local"] != everyone[m]["synced"], everyone
        assert everyone[m]["stored"] == served["rows"], everyone
    assert -4.1 < everyone[ctx.coordinator_rank]["global"] < -3.8, everyone


@check
def zz_all_done(w):
    popmesh.barrier(timeout=60)


if __name__ == "__main__":
    main()
