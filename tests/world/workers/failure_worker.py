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
