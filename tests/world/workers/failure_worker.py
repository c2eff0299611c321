"""Failure scenarios: a rank that never arrives (timeout names it), a rank that dies, and a failing
or crashing rank that the harness must take its peers down with."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import CommTimeout, PeerFailure
from worldlib import check, main

SCENARIO = os.environ.get("SCENARIO", "late")


@check
def silent_rank_is_named(w):
    last = w.size - 1
    if SCENARIO != "late":
        return
    if w.rank == last:
        time.sleep(6)  # stays alive but never calls the barrier
        return
    start = time.monotonic()
    try:
        popmesh.barrier(timeout=1.5)
    except CommTimeout as e:
        assert time.monotonic() - start < 10
        assert e.missing == (last,), (e.missing, str(e))
        assert f"ranks [{last}] did not arrive" in str(e)
    else:
        raise AssertionError("a barrier without the last rank must time out")


@check
def dead_rank_surfaces(w):
    if SCENARIO != "dead":
        return
    if w.rank == w.size - 1:
        os._exit(3)
    try:
        popmesh.all_reduce(np.ones(4), timeout=5)
    except PeerFailure as e:
        assert "all_reduce" in str(e)
        assert w.size - 1 in e.ranks, (e.ranks, e.exact, str(e))  # named, or among the suspects
    except CommTimeout as e:
        assert "all_reduce" in str(e)
    else:
        raise AssertionError("reducing with a dead rank must fail")


@check
def dead_rank_is_named_by_collectives(w):
    """Rank 1 of 3 dies: the survivors' all_reduce (in gloo's ring each survivor talks to rank 1), on
    the world and on subgroups (one in reversed order, so group ranks differ from global ones), raises
    PeerFailure naming rank 1 exactly; gloo's own error names only an address. (A broadcast from rank 0
    would not do: rank 0 fails at once and abandons it, and rank 2, which hears only from rank 0 there,
    can but time out.)"""
    if SCENARIO != "dead-middle":
        return
    groups = {"the world": None, "a subgroup": w.new_group([0, 1, 2]), "a reversed subgroup": w.new_group([2, 1, 0])}
    popmesh.barrier(timeout=30)
    if w.rank == 1:
        os._exit(3)
    for name, group in groups.items():
        try:
            popmesh.all_reduce(np.ones(4), group=group, timeout=10)
        except PeerFailure as e:
            assert (e.ranks, e.exact) == ((1,), True), (name, e.ranks, e.exact, str(e))
            assert "all_reduce: rank(s) [1] closed their connection" in str(e), (name, str(e))
        else:
            raise AssertionError(f"an all_reduce on {name} with a dead rank must fail")


@check
def one_rank_fails_while_peers_wait(w):
    """The harness must take the world down at once: the peers would wait here for 30 s."""
    if SCENARIO not in ("fail", "crash"):
        return
    if pid_dir := os.environ.get("POPMESH_TEST_PIDDIR"):
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(os.getpid()))
    popmesh.barrier(timeout=30)
    if w.rank == 1:
        if SCENARIO == "crash":
            os._exit(7)
        raise AssertionError("deliberate failure on rank 1")
    popmesh.barrier(timeout=30)


@check
def after_the_failure(w):
    if SCENARIO in ("fail", "crash"):
        popmesh.barrier(timeout=30)


if __name__ == "__main__":
    main()
