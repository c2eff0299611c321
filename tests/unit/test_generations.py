"""The agreement on generations of a re-forming world, over an in-memory store (no processes)."""

import threading
import time

import pytest
from memory_store import MemoryStore

from popmesh.core.errors import CommTimeout, ConfigError
from popmesh.engines.torch import generations as g


def _formed_world(size: int = 3) -> MemoryStore:
    store = MemoryStore()
    g.start_counting(store, size)
    g.start_counting(store, size)  # every rank calls it: only the first sets
    g.mark_formed(store, 0)
    return store


def test_survivors_that_start_a_new_attempt_together_land_on_the_same_one():
    store = _formed_world()
    assert {g.next_attempt(store, 0) for _ in range(3)} == {1}


def test_a_newcomer_before_or_after_the_survivors_noticed_joins_their_attempt():
    early = _formed_world()
    assert g.newcomer_attempt(early, 1, 1.0) == 1 and g.next_attempt(early, 0) == 1
    late = _formed_world()
    assert g.next_attempt(late, 0) == 1 and g.newcomer_attempt(late, 1, 1.0) == 1


def test_a_failed_attempt_moves_everyone_to_the_next_and_newcomers_follow():
    store = _formed_world()
    assert g.next_attempt(store, 0) == 1
    assert g.next_attempt(store, 1) == 2  # attempt 1 failed while forming
    assert g.newcomer_attempt(store, 1, 1.0) == 2  # a process restarted now joins attempt 2, not 1
    g.mark_formed(store, 2)
    assert g.newcomer_attempt(store, 1, 1.0) == 3


def test_waiting_members_see_a_superseded_attempt_at_once():
    store = _formed_world()
    g.check_in(store, 1, 0, fresh=False)
    g.next_attempt(store, 0)
    g.next_attempt(store, 1)
    start = time.monotonic()
    with pytest.raises(g.Superseded) as raised:
        g.await_members(store, 1, (0, 1, 2), time.monotonic() + 5)
    assert raised.value.newer == 2 and time.monotonic() - start < 1


def test_an_attempt_forms_once_every_rank_checked_in_and_names_the_newcomers():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    for rank, fresh in ((0, False), (2, False)):
        g.check_in(store, attempt, rank, fresh=fresh)
    joined = threading.Timer(0.05, g.check_in, args=(store, attempt, 1), kwargs={"fresh": True})
    joined.start()
    g.await_members(store, attempt, (0, 1, 2), time.monotonic() + 5)
    assert g.newcomers(store, attempt, (0, 1, 2)) == (1,)


def test_a_rank_that_never_comes_back_is_named():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    g.check_in(store, attempt, 0, fresh=False)
    with pytest.raises(CommTimeout, match=r"rank\(s\) \[1, 2\] never joined generation 1") as raised:
        g.await_members(store, attempt, (0, 1, 2), time.monotonic() + 0.1)
    assert raised.value.missing == (1, 2)


def test_a_newcomer_with_no_formed_world_times_out_clearly():
    with pytest.raises(CommTimeout, match="no world has formed yet"):
        g.newcomer_attempt(MemoryStore(), 1, 0.05)


def test_survivors_see_a_newcomer_waiting_only_once_it_checked_in_under_a_newer_attempt():
    store = _formed_world()
    assert not g.newcomer_waiting(store, 0)  # nobody restarted yet
    g.check_in(store, g.next_attempt(store, 0), 2, fresh=False)  # a survivor that re-forms at once: no newcomer
    assert not g.newcomer_waiting(store, 0)
    attempt = g.newcomer_attempt(store, 1, 1.0)
    assert attempt == 1 and not g.newcomer_waiting(store, 0)
    g.check_in(store, attempt, 1, fresh=True)
    assert g.newcomer_waiting(store, 0) and not g.newcomer_waiting(store, 1)  # a later generation waits for more


def test_a_newcomer_that_moved_to_a_newer_attempt_is_still_seen():
    store = _formed_world()
    g.check_in(store, g.newcomer_attempt(store, 1, 1.0), 1, fresh=True)
    newer = g.next_attempt(store, 1)  # attempt 1 failed while it formed
    assert not g.newcomer_waiting(store, 0)  # until the newcomer checks in again under it
    g.check_in(store, newer, 1, fresh=True)
    assert g.newcomer_waiting(store, 0)


def test_a_newcomer_whose_previous_process_died_while_an_attempt_formed_joins_the_next():
    """The others may hold the dead process's address in that attempt's group: it cannot form."""
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    for rank in range(3):
        g.check_in(store, attempt, rank, fresh=rank == 1)  # rank 1 restarted once already; all checked in
    assert g.newcomer_attempt(store, 2, 1.0) == 2  # rank 2 died while attempt 1 formed: not attempt 1
    assert g.next_attempt(store, 1) == 2  # the survivors, giving up on attempt 1, land on the same one
    assert g.newcomer_attempt(store, 2, 1.0) == 2  # not past it: rank 2 has not checked in under attempt 2


def test_a_newcomer_that_never_checked_in_under_the_newest_attempt_joins_it():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    g.check_in(store, attempt, 0, fresh=False)
    assert g.newcomer_attempt(store, 1, 1.0) == attempt  # the survivors started it for this rank


def test_an_attempt_is_taken_once_every_rank_s_group_is_up():
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    for rank in (0, 2):
        g.mark_up(store, attempt, rank)
    threading.Timer(0.05, g.mark_up, args=(store, attempt, 1)).start()
    g.await_up(store, attempt, (0, 1, 2), time.monotonic() + 5)


def test_ranks_whose_group_is_up_leave_an_attempt_a_member_never_finished():
    """A member died after gloo had its address: some ranks' groups formed, its restart moves everyone on."""
    store = _formed_world()
    attempt = g.next_attempt(store, 0)
    for rank in range(3):
        g.check_in(store, attempt, rank, fresh=False)
    g.mark_up(store, attempt, 0)
    g.mark_up(store, attempt, 1)
    with pytest.raises(CommTimeout, match=r"rank\(s\) \[2\] joined generation 1 but never finished") as raised:
        g.await_up(store, attempt, (0, 1, 2), time.monotonic() + 0.1)  # nobody restarted rank 2: named at the deadline
    assert raised.value.missing == (2,)
    assert g.newcomer_attempt(store, 2, 1.0) == 2
    start = time.monotonic()
    with pytest.raises(g.Superseded) as superseded:
        g.await_up(store, attempt, (0, 1, 2), time.monotonic() + 5)
    assert superseded.value.newer == 2 and time.monotonic() - start < 1


class _LastKeyLate(MemoryStore):
    """The last rank's key arrives just as a waiting rank reads the newer attempt."""

    def __init__(self, late: str) -> None:
        super().__init__()
        self.late = late

    def get(self, key):
        if key == g.ATTEMPT and self.late:
            self.data[self.late], self.late = b"1", ""
        return super().get(key)


def test_an_attempt_whose_last_rank_came_up_as_a_newer_one_started_is_still_taken():
    """Every rank that saw all groups up takes the attempt: a rank that saw the newer one first must too."""
    store = _LastKeyLate("popmesh/gen/1/up/2")
    g.start_counting(store, 3)
    g.mark_formed(store, 0)
    g.next_attempt(store, 0)
    g.mark_up(store, 1, 0)
    g.mark_up(store, 1, 1)
    g.next_attempt(store, 1)  # a newer attempt started (a rank died right after its group came up)
    g.await_up(store, 1, (0, 1, 2), time.monotonic() + 5)  # no Superseded: every group of attempt 1 is up


def test_a_rank_whose_restarted_process_waits_is_known_lost_without_a_heartbeat():
    """Survivors agreeing on their group (their heartbeat stopped) learn of a further loss from the store."""
    store = _formed_world(4)
    assert g.restarted_ranks(store, 0, (0, 1, 2, 3)) == frozenset()
    attempt = g.next_attempt(store, 0)
    g.check_in(store, attempt, 0, fresh=False)  # a survivor that moved on: not a restarted process
    assert g.restarted_ranks(store, 0, (0, 1, 2, 3)) == frozenset()
    g.check_in(store, attempt, 2, fresh=True)
    assert g.restarted_ranks(store, 0, (0, 1, 2, 3)) == frozenset({2})
    assert g.restarted_ranks(store, attempt, (0, 1, 2, 3)) == frozenset(), "a generation after it has nothing to learn"


def test_the_first_world_s_roster_is_every_launcher_rank_in_order():
    store = _formed_world(3)
    assert g.roster(store, 0) == (0, 1, 2)
    assert g.agree_roster(store, g.next_attempt(store, 0)) == (0, 1, 2)  # a restart keeps every slot


def test_joined_slots_come_after_the_members_lowest_first_and_a_later_one_after_them():
    store = _formed_world(2)
    g.register_joiner(store, 7)
    g.register_joiner(store, 6)
    attempt = g.next_attempt(store, 0)
    assert g.agree_roster(store, attempt) == (0, 1, 6, 7)
    g.register_joiner(store, 4)  # too late for this attempt's roster: it is set once
    assert g.agree_roster(store, attempt) == (0, 1, 6, 7)
    g.mark_formed(store, attempt)
    assert g.agree_roster(store, g.next_attempt(store, attempt)) == (0, 1, 6, 7, 4)  # the members keep their ranks


def test_a_launcher_s_ranks_wait_for_each_other_to_register():
    store = _formed_world(2)
    g.register_joiner(store, 4)
    threading.Timer(0.05, g.register_joiner, args=(store, 5)).start()
    g.await_node(store, 4, 2, time.monotonic() + 5)
    g.register_joiner(store, 6)
    with pytest.raises(CommTimeout, match=r"rank\(s\) \[7\] of this launcher never registered"):
        g.await_node(store, 6, 2, time.monotonic() + 0.1)


def test_a_slot_marked_left_is_left_out_and_the_ranks_above_it_move_down():
    store = _formed_world(4)
    g.mark_left(store, 1)
    members = g.agree_roster(store, g.next_attempt(store, 0))
    assert members == (0, 2, 3) and members.index(3) == 2
    assert g.left_count(store) == 1  # survivors that train alone see it in one read, and re-form
    assert g.restarted_ranks(store, 0, (0, 1, 2, 3)) == frozenset({1})  # lost, though no heartbeat said so


def test_an_attempt_waiting_for_a_slot_then_marked_left_moves_on_without_it():
    store = _formed_world(3)
    attempt = g.next_attempt(store, 0)
    members = g.agree_roster(store, attempt)
    for slot in (0, 2):
        g.check_in(store, attempt, slot, fresh=False)
    threading.Timer(0.05, g.mark_left, args=(store, 1)).start()
    with pytest.raises(g.Superseded) as raised:
        g.await_members(store, attempt, members, time.monotonic() + 5)
    assert raised.value.newer == attempt + 1
    assert g.agree_roster(store, raised.value.newer) == (0, 2)


def test_nodes_are_counted_from_slots():
    assert g.nodes_of((0, 1, 2, 3), 2) == (0, 1)
    assert g.nodes_of((0, 5), 2) == (0, 2)
    assert g.nodes_of((), 2) == ()


def test_a_joiner_is_refused_for_another_launcher_size_a_slot_in_use_or_another_version():
    store = MemoryStore()
    g.start_counting(store, 4, per_node=2)
    g.mark_formed(store, 0)
    g.refuse_joiner(store, 4, 2)  # node 2 of two ranks: welcome
    with pytest.raises(ConfigError, match=r"starts 4 rank\(s\) \(-n 4\), the running world's nodes 2 each"):
        g.refuse_joiner(store, 4, 4)
    with pytest.raises(ConfigError, match="rank 3 of the launchers' numbering is in the running world already"):
        g.refuse_joiner(store, 3, 2)
    store.set("popmesh/version", "0.0.1")
    with pytest.raises(ConfigError, match=r"the running world popmesh 0\.0\.1"):
        g.refuse_joiner(store, 4, 2)


def test_a_joiner_whose_model_fingerprint_differs_is_refused_before_it_registers():
    store = MemoryStore()
    g.start_counting(store, 2, per_node=2, fingerprint="Net: 2 tensors, 10 elements, aaa")
    g.mark_formed(store, 0)
    g.refuse_joiner(store, 2, 2, "Net: 2 tensors, 10 elements, aaa")
    g.refuse_joiner(store, 2, 2, None)  # a joiner that names none is not checked
    with pytest.raises(ConfigError, match=r"this process's model \(Net: 2 tensors, 12 elements, bbb\) is not"):
        g.refuse_joiner(store, 2, 2, "Net: 2 tensors, 12 elements, bbb")
    assert g.joiners(store) == []  # the running world never saw it
