"""The pure parts of failure injection: delays, the choice of rank, the checks of the options."""

import random
import statistics

import pytest

from popmesh.core.errors import ConfigError
from popmesh.launch.inject import FailureInjection, check_injection, next_delay, pick_victim


def test_delays_are_exponential_with_the_asked_mean_and_reproducible():
    draws = [next_delay(random.Random(7), 6.0) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # one seed, one sequence
    rng = random.Random(0)
    many = [next_delay(rng, 6.0) for _ in range(20_000)]
    assert min(many) > 0 and statistics.mean(many) == pytest.approx(10.0, rel=0.05)  # 6 a minute: every 10 s


def test_the_victim_is_one_of_the_candidates_and_none_without_any():
    rng = random.Random(1)
    picks = {pick_victim(rng, [3, 1, 2]) for _ in range(200)}
    assert picks == {1, 2, 3}
    assert pick_victim(rng, []) is None
    assert pick_victim(random.Random(5), [2, 0]) == pick_victim(random.Random(5), [0, 2])  # order does not matter


@pytest.mark.parametrize("injection,engine,restarts,message", [
    (FailureInjection(2.0), "torch", 0, r"add --max-restarts N"),
    (FailureInjection(-1.0), "torch", 1, r"--inject-failures -1.0: give the mean number of kills per minute"),
    (FailureInjection(float("nan")), "torch", 1, r"--inject-failures nan"),
    (FailureInjection(2.0, after_s=-1), "torch", 1, r"--inject-after -1"),
    (FailureInjection(2.0, limit=0), "torch", 1, r"--inject-max 0"),
    (FailureInjection(2.0), "mpi", 1, r"only the torch engine restarts a lost rank"),
])
def test_bad_injections_are_config_errors_that_say_what_to_do(injection, engine, restarts, message):
    with pytest.raises(ConfigError, match=message):
        check_injection(injection, engine, restarts)
    check_injection(FailureInjection(2.0), "torch", 1)
