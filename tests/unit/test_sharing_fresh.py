"""fresh: which shared rollouts an agent learns from (pure)."""

from popmesh.population.mechanisms.sharing import fresh


def test_every_rollout_within_max_age_is_kept_in_arrival_order():
    arrived = [(1, 3, "a"), (2, 4, "b"), (1, 5, "c"), (1, 4, "d")]
    assert fresh(arrived, 5, 2) == arrived


def test_rollouts_older_than_max_age_are_dropped():
    arrived = [(1, 2, "old"), (2, 4, "fresh"), (3, 3, "edge")]
    assert fresh(arrived, 5, 2) == [(2, 4, "fresh"), (3, 3, "edge")]
    assert fresh(arrived, 5, 0) == []


def test_a_sender_ahead_of_the_taker_is_fresh():
    assert fresh([(1, 9, "ahead")], 5, 0) == [(1, 9, "ahead")]


def test_nothing_arrived_is_nothing_kept():
    assert fresh([], 3, 5) == []


def test_a_limit_keeps_the_newest_in_arrival_order():
    arrived = [(1, 3, "a"), (2, 6, "b"), (1, 5, "c"), (3, 6, "d"), (2, 4, "e")]
    assert fresh(arrived, 6, 8, 3) == [(2, 6, "b"), (1, 5, "c"), (3, 6, "d")]
    assert fresh(arrived, 6, 8, 10) == arrived
    assert fresh(arrived, 6, 1, 3) == [(2, 6, "b"), (1, 5, "c"), (3, 6, "d")]


def test_of_two_as_new_the_later_arrival_is_kept():
    assert fresh([(1, 4, "first"), (2, 4, "second")], 4, 2, 1) == [(2, 4, "second")]
