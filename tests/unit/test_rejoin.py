"""Which survivors seed a rank that rejoined the population (pure)."""

import math

import pytest

from popmesh.core.errors import ConfigError
from popmesh.population.state.rejoin import choose_donors


def test_the_best_survivors_donate_best_first():
    assert choose_donors([5.0, 9.0, 7.0, 1.0], [0, 1, 2, 3], newcomers=[1], k=2) == [2, 0]


def test_nan_metrics_come_last_and_ties_go_to_the_lower_rank():
    nan = math.nan
    assert choose_donors([nan, 3.0, 3.0, nan], [0, 1, 2, 3], newcomers=[], k=3) == [1, 2, 0]


def test_fewer_survivors_than_donors_asked_for_give_all_of_them():
    assert choose_donors([1.0, 2.0, 3.0], [4, 5, 6], newcomers=[4, 6], k=2) == [5]


def test_no_survivor_or_no_donor_is_a_clear_error():
    with pytest.raises(ConfigError, match="no survivor"):
        choose_donors([1.0, 2.0], [0, 1], newcomers=[0, 1], k=1)
    with pytest.raises(ConfigError, match="at least one donor"):
        choose_donors([1.0], [0], newcomers=[], k=0)
