"""Roles and the replay-buffer service on 2, 3 and 4 ranks: one manager after the trainers, and from 4
ranks a coordinator last. 2 ranks: trainer 0, manager 1. 3: trainers 0 and 1, manager 2. 4: trainers 0
and 1, manager 2, coordinator 3.

Trainer r's states lie near 100 * r, so a batch's novelty against the other trainer's rows is large,
and a batch sent twice scores exactly 0 the second time (the manager scores before inserting).
Rewards: trainer 0's batch minima are -2, trainer 1's -3, so every baseline (an EMA of minima, or
the coordinator's min of it) lies in [-3, -2] and the rows filtering keeps are known in advance.
"""

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import ConfigError
from popmesh.buffers import Coordinator, ReplayBufferClient, ReplayBufferManager, ServiceError, novelty_score
from popmesh.buffers.protocol import REQUEST_TAG, SCORE_TAG, Message, MessageType, from_payload, to_payload
from popmesh.comm import messages as m
from popmesh.topology.layout import RankLayout
from worldlib import check, main

CTX = {}


def layout(n):
    """(trainers, manager, coordinator or None) of an n-rank world here."""
    coordinated = n >= 4
    trainers = list(range(n - 1 - coordinated))
    return trainers, len(trainers), n - 1 if coordinated else None


def roles(w):
    coordinator = layout(w.size)[2]
    return popmesh.assign_roles(w, num_buffers=1, use_coordinator=coordinator is not None)


def batch(states, rewards):
    return {"states": np.asarray(states, np.float32), "log_rewards": np.asarray(rewards, np.float64)}


def scoring(b, store):
    return {"score": novelty_score("states")(b, store), "modes": [str(int(x)) for x in b["states"][:, 0]]}


@check
def context_roles_and_groups(w):
    ctx = CTX["ctx"] = roles(w)
    r, (trainers, manager, coordinator) = w.rank, layout(w.size)
    t = len(trainers)
    assert ctx.training_ranks == trainers and ctx.buffer_rank_set == {manager}
    assert ctx.coordinator_rank == coordinator
    assert (ctx.is_training_rank(), ctx.is_buffer_rank(), ctx.is_coordinator_rank()) == (
        r < t, r == manager, r == coordinator)
    assert ctx.assigned_buffer == (manager if r < t else None)
    assert ctx.assigned_training_ranks == (trainers if r == manager else None)
    assert ctx.num_training_ranks == t and ctx.agent_group_size == t and ctx.agent_group_id == 0
    assert [g.ranks for g in ctx.agent_groups] == [tuple(trainers)]
    assert ctx.train_global_group is ctx.agent_groups[0]
    assert ctx.buffer_group.ranks == (manager,) and ctx.buffer_group.is_member == (r == manager)
    if ctx.is_training_rank():
        assert popmesh.all_reduce(r + 1, group=ctx.train_global_group) == t * (t + 1) // 2
        assert ctx.agent_group is ctx.agent_groups[0]
    if ctx.is_buffer_rank():
        assert popmesh.all_reduce(r + 1, group=ctx.buffer_group) == manager + 1


@check
def context_from_an_explicit_layout(w):
    trainers, manager, coordinator = layout(w.size)
    explicit = RankLayout.build(w.size, num_buffers=1, use_coordinator=coordinator is not None)
    ctx = popmesh.assign_roles(w, explicit)
    assert ctx.layout == explicit and ctx.assigned_buffer == (manager if w.rank in trainers else None)
    ctx.cleanup()
    ctx.cleanup()
    assert not w.finalized
    other = RankLayout.build(w.size, num_buffers=0) if w.rank == 0 else explicit
    try:
        popmesh.assign_roles(w, other)
    except ConfigError as e:
        assert "different RankLayout" in str(e)
    else:
        raise AssertionError("ranks passing different layouts must all get ConfigError")


def trainer_sync_with_filtering(ctx):
    c = ReplayBufferClient.from_context(ctx, capacity=16, mode="sync", baseline_filtering=True)
    a = batch([[0, 0], [1, 1]], [-1.0, -2.0])
    first = c.add(a)
    assert first["score"] > 50 and first["rows"] == 2, first  # novel against trainer 1's rows (or an empty store)
    assert -3 <= c.baseline <= -2, c.baseline
    assert c.add(a)["score"] == 0.0  # scored before inserting: the earlier copy is what it is compared with
    assert c.add(batch([[5, 5], [6, 6], [7, 7]], [-100.0, -1.5, 0.0]))["rows"] == 2  # the -100 row is filtered
    assert c.add(batch([[8, 8]], [-100.0])) is None and c.skipped == 1
    return c


def trainer_async_comm(ctx):
    c = ReplayBufferClient.from_context(ctx, capacity=16, mode="async-comm")
    b1 = batch([[100, 100], [101, 101]], [-3.0, -3.0])
    assert c.add(b1) is None
    assert c.add(batch([[102, 102]], [-3.0]))["score"] > 50  # b1's score arrives one step late
    assert math.isclose(c.add(b1)["score"], math.sqrt(2), rel_tol=1e-6)  # (102, 102) vs the stored (101, 101)
    return c


def bad_requests_get_error_replies(w, manager):
    raw = Message(MessageType.MODE_REPORT, {"modes": ["x"]})
    m.send(to_payload(raw), manager, REQUEST_TAG)  # a type managers do not handle
    m.send({"not": "a service message"}, manager, REQUEST_TAG)
    w.engine.p2p().send(b"\x00garbage frame", manager, int(REQUEST_TAG), 30)
    for _ in range(3):
        _src, payload = m.recv(manager, SCORE_TAG, timeout=30)
        assert from_payload(payload).type is MessageType.ERROR


def wait_for_modes(c, expected):
    deadline = time.monotonic() + 30
    while True:
        stats = c.population_stats()
        if stats["modes_found"] == expected or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@check
def service_round_trip(w):
    """Trainer 0 sends 3 batches (6 rows: one row and one batch filtered) and bad requests, trainer 1
    3 batches (5 rows); with a coordinator, the modes of both (4 and 3) meet there."""
    ctx = CTX["ctx"]
    trainers, manager, coordinator = layout(w.size)
    if ctx.is_buffer_rank():
        mgr = ReplayBufferManager.from_context(ctx, capacity=64, scoring_function=scoring)
        stats = mgr.run(idle_timeout=90)
        t = len(trainers)
        assert stats.messages["DATA"] == 3 * t and stats.messages["EXIT"] == t, stats.messages
        assert stats.messages["GET_METADATA"] == 1
        assert dict(stats.rows_from) == ({0: 6, 1: 5} if t == 2 else {0: 6}), stats.rows_from
        assert stats.errors == 3 and mgr.done
        result = {"synced": mgr._synced, "stored": len(mgr.store)}
    elif ctx.is_coordinator_rank():
        final = Coordinator.from_context(ctx).run(idle_timeout=90)
        assert final["modes_found"] == 7 and final["modes_by_rank"] == {"0": 4, "1": 3}, final
        assert final["active_managers"] == []
        result = {"global": final["global_baseline"]}
    else:
        c = trainer_sync_with_filtering(ctx) if w.rank == 0 else trainer_async_comm(ctx)
        if w.rank == 0:
            bad_requests_get_error_replies(w, manager)
            meta = c.get_metadata()
            assert meta["capacity"] == 64 and meta["stored"] >= 6, meta
        popmesh.barrier(group=ctx.train_global_group)
        if coordinator is not None:
            stats = wait_for_modes(c, 7)
            assert stats["modes_found"] == 7 and -3 <= stats["global_baseline"] <= -2, stats
        last = c.drain()
        assert c.drain() is last
        if w.rank == 1:
            assert last["score"] == 0.0  # the re-sent b1, collected by drain()
        try:
            c.add(batch([[0, 0]], [0.0]))
        except ConfigError:
            pass
        else:
            raise AssertionError("add() after drain() must fail")
        result = {}
    everyone = popmesh.all_gather_object(result)
    if coordinator is None:  # no global baseline to adopt
        assert everyone[manager]["synced"] is None and everyone[manager]["stored"] == 6 + 5 * (len(trainers) > 1)
    else:  # the manager adopted a global baseline (the last sync may still be in flight when it exits)
        assert -3 <= everyone[manager]["synced"] <= -2 and -3 <= everyone[coordinator]["global"] <= -2, everyone


def refused(add, *causes):
    try:
        add()
    except ServiceError as e:
        assert all(cause in str(e) for cause in causes), str(e)
    else:
        raise AssertionError(f"the manager must refuse this request ({causes})")


@check
def a_bad_batch_is_refused_and_the_service_goes_on(w):
    """Trainer 0 sends a good batch, then (from a second client, whose local buffer is still empty) rows
    of another shape, which killed the manager before: it must refuse them with an ERROR naming the
    shapes and go on serving trainer 0's next batch and all of trainer 1's (sent meanwhile). From 4
    ranks the coordinator rank, which the manager does not serve, sends DATA and is refused too. Every
    refusal is answered before an agent leaves (a barrier of the non-manager ranks)."""
    trainers, manager, coordinator = layout(w.size)
    others = w.new_group([r for r in range(w.size) if r != manager])
    if w.rank == manager:
        mgr = ReplayBufferManager(trainers, capacity=64, scoring_function=novelty_score("states"), group=w)
        stats = mgr.run(idle_timeout=60)
        assert stats.errors == 1 + (coordinator is not None), stats.to_dict()
        assert dict(stats.rows_from) == ({0: 4, 1: 6} if len(trainers) == 2 else {0: 4}), stats.rows_from
        assert len(mgr.store) == sum(stats.rows_from.values()) and mgr.done
        assert stats.messages["DATA"] == 3 * len(trainers) + (coordinator is not None), stats.messages
        return
    client = ReplayBufferClient(manager, group=w, timeout=30, mode="async-comm" if w.rank == 1 else "sync")
    good = batch([[0, 0], [1, 1]], [-1.0, -2.0])
    if w.rank == 0:
        assert client.add(good)["rows"] == 2
        bad = batch([[0, 0, 0], [1, 1, 1]], [-1.0, -2.0])
        refused(lambda: ReplayBufferClient(manager, group=w, timeout=30).add(bad), f"rank {manager} refused DATA",
                "'states' has rows of shape (3,)", "stored rows have shape (2,)")
        assert client.add(good)["score"] == 0.0  # served after the refusal, scored against its first copy
    elif w.rank in trainers:
        for i in range(3):
            client.add(batch([[100 + 2 * i, 100], [101 + 2 * i, 100]], [-3.0, -3.0]))
    else:  # the coordinator rank: not an agent of this manager
        refused(lambda: client.add(batch([[5, 5]], [0.0])), "does not serve it")
    popmesh.barrier(group=others, timeout=60)
    if w.rank in trainers:
        assert client.drain()["rows"] == 2


@check
def manager_errors_are_not_fatal_but_misuse_is_refused(w):
    ctx = CTX["ctx"]
    for make in (lambda: ReplayBufferManager.from_context(ctx) if not ctx.is_buffer_rank() else None,
                 lambda: Coordinator.from_context(ctx) if not ctx.is_coordinator_rank() else None,
                 lambda: ReplayBufferClient.from_context(ctx) if not ctx.is_training_rank() else None):
        try:
            made = make()
        except ConfigError:
            continue
        assert made is None
    if ctx.is_training_rank():
        try:
            ReplayBufferClient(None, baseline_filtering=True)
        except ConfigError:
            pass
        else:
            raise AssertionError("filtering without a manager must be refused")


@check
def timing_reports_across_ranks(w):
    from popmesh.observe.reports import Timer

    timer = Timer()
    for _ in range(3):
        timer.record("step", 0.1 * (w.rank + 1))
    everyone = popmesh.gather_timings(timer)
    assert (everyone == [{"step": [0.1 * (r + 1)] * 3} for r in range(w.size)]) if w.rank == 0 else everyone is None
    ctx = CTX["ctx"]
    if ctx.is_training_rank():
        last = ctx.training_ranks[-1]  # the slowest trainer: 0.1 s per step more than the one before
        report = popmesh.report_timings(timer, group=ctx.train_global_group, dst=last, show=False)
        assert (report is None) if w.rank != last else report.stragglers == ((last,) if last else ()), report
        imbalance = popmesh.report_imbalance(timer, group=ctx.train_global_group, dst=None, show=False)
        assert abs(imbalance.waiting_total - 3 * 0.05 * last) < 1e-9, imbalance


@check
def zz_all_done(w):
    popmesh.barrier(timeout=60)


if __name__ == "__main__":
    main()
