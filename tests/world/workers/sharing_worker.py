"""SampleSharing on real worlds: every rank publishes a rollout per iteration (arrays filled with a closed
form of its rank and iteration) and takes the others'; the last rank is five times slower, and the
others never wait for it."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import ConfigError
from popmesh.population.mechanisms.sharing import SampleSharing
from worldlib import check, main

ITERATIONS = 20
ITER_S = 0.02  # the fast ranks' iteration; the last rank's is five times longer


def rollout(rank: int, iteration: int) -> dict:
    return {"obs": np.full((64, 8, 4), rank * 1000 + iteration, np.float32),
            "act": np.full((64, 8), rank, np.float32), "made_at": np.array(iteration)}


def run(w, sharing: SampleSharing) -> tuple[list[tuple[int, int, int]], float]:
    """Publish and take each iteration; (iteration, sender, its iteration) per rollout taken, and the loop's seconds."""
    slow = w.size - 1
    taken, began = [], time.monotonic()
    for iteration in range(ITERATIONS):
        sharing.publish(rollout(w.rank, iteration), iteration)
        for got in sharing.take(iteration):
            sender, made_at = int(got["act"][0, 0]), int(got["made_at"])
            assert got["obs"].shape == (64, 8, 4) and got["obs"].dtype == np.float32, got["obs"].dtype
            assert np.all(got["obs"] == sender * 1000 + made_at), (sender, made_at)
            taken.append((iteration, sender, made_at))
        time.sleep(ITER_S * (5 if w.rank == slow else 1))
    return taken, time.monotonic() - began


@check
def rollouts_reach_every_other_rank_and_nobody_waits(w):
    sharing = SampleSharing(max_age=ITERATIONS)
    taken, seconds = run(w, sharing)
    popmesh.barrier(timeout=60)
    last = sharing.take(ITERATIONS)  # what came at the end: the newest of each sender
    sharing.close()
    popmesh.barrier(timeout=60)
    assert all(sender != w.rank for _, sender, _ in taken), taken
    senders = {sender for _, sender, _ in taken} | {int(got["act"][0, 0]) for got in last}
    assert senders == set(range(w.size)) - {w.rank}, (senders, taken)
    for sender in senders:  # each sender's rollouts come in the order it made them
        made = [m for _, s, m in taken if s == sender]
        assert made == sorted(made), (sender, made)
    if w.rank != w.size - 1:  # the slow rank takes 5 x 20 x 20 ms; a fast one is not held up by it
        assert seconds < 0.6 * ITERATIONS * ITER_S * 5, seconds
    assert sharing.sent + sharing.skipped == ITERATIONS * (w.size - 1), (sharing.sent, sharing.skipped)


@check
def a_rollout_older_than_max_age_is_never_taken(w):
    sharing = SampleSharing(max_age=1)
    taken, _ = run(w, sharing)
    popmesh.barrier(timeout=60)
    sharing.take(ITERATIONS)
    sharing.close()
    popmesh.barrier(timeout=60)
    assert all(made_at >= iteration - 1 for iteration, _, made_at in taken), taken
    if w.rank == w.size - 1 and w.size > 1:  # the slow rank sees the fast ones ahead of it: all fresh
        assert taken, taken


def refused(call, word: str) -> None:
    """``call()`` raises a ConfigError that names ``word``."""
    try:
        call()
    except ConfigError as e:
        assert word in str(e), str(e)
    else:
        raise AssertionError(f"taken: {word}")


@check
def bad_input_is_refused(w):
    for bad in (-1, 1.5, True):
        refused(lambda bad=bad: SampleSharing(max_age=bad), "max_age")
    for bad in (0, 2.0, False):
        refused(lambda bad=bad: SampleSharing(limit=bad), "limit")
    sharing = SampleSharing()
    refused(lambda: sharing.publish({"__iteration__": np.zeros(1)}, 0), "__iteration__")
    sharing.close()
    popmesh.barrier(timeout=60)


if __name__ == "__main__":
    main()
