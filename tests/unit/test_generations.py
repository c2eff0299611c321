"""The agreement on generations of a re-forming world, over an in-memory store (no processes)."""

import threading
import time

import pytest
from memory_store import MemoryStore

from popmesh.core.errors import CommTimeout
from popmesh.engines.torch import generations as g


def _formed_world(size: int = 3) -> MemoryStore:
    store = MemoryStore()
    g.start_counting(store)
    g.start_counting(store)  # every rank calls it: only the first sets
    g.mark_formed(store, 0)
    return store


def test_survivors_that_start_a_new_attempt_together_land_on_the_same_one():
    store = _formed_world()
    assert {g.next_attempt(store, 0) for _ in range(3)} == {1}


def test_a_newcomer_before_or_after_the_survivors_noticed_joins_their_attempt():
    early = _formed_world()
    assert g.newcomer_attempt(early, 1.0) == 1 and g.next_attempt(early, 0) == 1
    late = _formed_world()
    assert g.next_attempt(late, 0) == 1 and g.newcomer_attempt(late, 1.0) == 1


def test_a_failed_attempt_moves_everyone_to_the_next_and_newcomers_follow():
    store = _formed_world()
    assert g.next_attempt(store, 0) == 1
    assert g.next_attempt(store, 1) == 2  # attempt 1 failed while forming
    assert g.newcomer_attempt(store, 1.0) == 2  # a process restarted now joins attempt 2, not 1
    g.mark_formed(store, 2)
    assert g.newcomer_attempt(store, 1.0) == 3


def test_waiting_members_see_a_superseded_attempt_at_once():
    store = _formed_world()
    g.check_in(store, 1, 0, fresh=False)
    g.next_attempt(store, 0)
    g.next_attempt(store, 1)
    start = time.monotonic()
    with pytest.raises(g.Superseded) as raised:
        g.await_members(store, 1, 3, time.monotonic() + 5)
    assert raised.value.newer == 2 and time.monotonic() - start < 1


def test_an_attempt_forms_once_every_rank_checked_in_and_names_the_newcomers():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    for rank, fresh in ((0, False), (2, False)):
        g.check_in(store, attempt, rank, fresh=fresh)
    joined = threading.Timer(0.05, g.check_in, args=(store, attempt, 1), kwargs={"fresh": True})
    joined.start()
    g.await_members(store, attempt, 3, time.monotonic() + 5)
    assert g.newcomers(store, attempt, 3) == (1,)


def test_a_rank_that_never_comes_back_is_named():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    g.check_in(store, attempt, 0, fresh=False)
    with pytest.raises(CommTimeout, match=r"rank\(s\) \[1, 2\] never joined generation 1") as raised:
        g.await_members(store, attempt, 3, time.monotonic() + 0.1)
    assert raised.value.missing == (1, 2)


def test_a_newcomer_with_no_formed_world_times_out_clearly():
    with pytest.raises(CommTimeout, match="no world has formed yet"):
        g.newcomer_attempt(MemoryStore(), 0.05)


def test_survivors_see_a_newcomer_waiting_only_once_it_checked_in_under_a_newer_attempt():
    store = _formed_world()
    assert not g.newcomer_waiting(store, 0)  # nobody restarted yet
    g.check_in(store, g.next_attempt(store, 0), 2, fresh=False)  # a survivor that re-forms at once: no newcomer
    assert not g.newcomer_waiting(store, 0)
    attempt = g.newcomer_attempt(store, 1.0)
    assert attempt == 1 and not g.newcomer_waiting(store, 0)
    g.check_in(store, attempt, 1, fresh=True)
    assert g.newcomer_waiting(store, 0) and not g.newcomer_waiting(store, 1)  # a later generation waits for more


def test_a_newcomer_that_moved_to_a_newer_attempt_is_still_seen():
    store = _formed_world()
    g.check_in(store, g.newcomer_attempt(store, 1.0), 1, fresh=True)
    newer = g.next_attempt(store, 1)  # attempt 1 failed while it formed
    assert not g.newcomer_waiting(store, 0)  # until the newcomer checks in again under it
    g.check_in(store, newer, 1, fresh=True)
    assert g.newcomer_waiting(store, 0)
