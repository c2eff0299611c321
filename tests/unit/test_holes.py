"""How survivors of a lost rank agree on their group, over an in-memory store (no processes)."""

import threading
import time

import pytest
from memory_store import MemoryStore

from popmesh.core.errors import CommTimeout, PeerFailure
from popmesh.engines.torch import holes as h


def _agree_all(store, ranks, size, known, generation=3, timeout=5.0):
    """Every rank of ``ranks`` agrees at once, each knowing the lost ranks ``known[rank]`` (a set it may
    grow meanwhile); each rank's (members, round) or its exception."""
    out: dict[int, object] = {}

    def run(rank):
        try:
            out[rank] = h.agree_survivors(store, generation, rank, size, lambda: set(known[rank]),
                                          time.monotonic() + timeout)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def test_ranks_round_trip_through_the_store_sorted():
    assert h.encode_ranks({3, 1}) == "1,3" and h.decode_ranks(b"1,3") == frozenset({1, 3})


def test_survivors_that_know_the_same_loss_agree_in_the_first_round():
    got = _agree_all(MemoryStore(), [0, 1, 3], 4, {r: {2} for r in (0, 1, 3)})
    assert got == {r: ((0, 1, 3), 0) for r in (0, 1, 3)}


def test_a_survivor_that_knows_of_a_second_loss_moves_everyone_to_a_round_without_it():
    store = MemoryStore()
    known = {0: {2}, 1: {2}, 3: {2}, 4: {2}}
    h.propose_lost(store, 3, 0, {2})  # the first proposer had seen only rank 2 lost
    known[4] = {2, 3}  # rank 4 knows rank 3 died too: rank 3 never takes part

    def rank_3_found_lost_later():
        time.sleep(0.2)
        for r in (0, 1):
            known[r] = {2, 3}

    threading.Thread(target=rank_3_found_lost_later).start()
    got = _agree_all(store, [0, 1, 4], 5, known)
    assert {r: got[r][0] for r in (0, 1, 4)} == {r: (0, 1, 4) for r in (0, 1, 4)}
    assert len({got[r][1] for r in (0, 1, 4)}) == 1 and got[0][1] >= 1


def test_a_member_that_fails_before_taking_part_starts_a_new_round():
    known = {0: {1}, 2: {1}}

    def rank_3_dies():
        time.sleep(0.2)
        known[0] = known[2] = {1, 3}

    threading.Thread(target=rank_3_dies).start()
    got = _agree_all(MemoryStore(), [0, 2], 4, known)  # rank 3 never takes part
    assert got[0] == got[2] and got[0][0] == (0, 2) and got[0][1] == 1


def test_a_rank_the_others_found_lost_is_told_so():
    store = MemoryStore()
    h.propose_lost(store, 3, 0, {1})
    with pytest.raises(PeerFailure, match="found rank 1 lost") as caught:
        h.agree_survivors(store, 3, 1, 3, lambda: {2}, time.monotonic() + 1.0)
    assert caught.value.ranks == (1,)


def test_a_survivor_that_never_takes_part_is_named_at_the_deadline():
    store = MemoryStore()
    with pytest.raises(CommTimeout, match=r"rank\(s\) \[2\] never took part") as caught:
        h.agree_survivors(store, 0, 0, 3, lambda: {1}, time.monotonic() + 0.3)
    assert caught.value.missing == (2,)


def test_a_later_loss_never_forms_an_older_round_again():
    store = MemoryStore()
    first = _agree_all(store, [0, 1, 2], 4, {r: {3} for r in (0, 1, 2)})
    assert first[0] == ((0, 1, 2), 0)
    second = _agree_all(store, [0, 1], 4, {r: {2, 3} for r in (0, 1)})
    assert second == {0: ((0, 1), 1), 1: ((0, 1), 1)}
