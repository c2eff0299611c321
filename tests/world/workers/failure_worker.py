"""Failure scenarios: a rank that never arrives (timeout names it) and a rank that dies."""

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


if __name__ == "__main__":
    main()
