"""The population skeleton (PopulationPolicy): cadence, group of one and metric checks, in one place."""

from __future__ import annotations

import pytest

from popmesh.core.errors import ConfigError
from popmesh.population import (
    AsyncSelectiveAveraging,
    AverageAll,
    OneSidedAveraging,
    PopulationPolicy,
    SelectiveAveraging,
)
from popmesh.population.mechanisms.info import PolicyInfo

torch = pytest.importorskip("torch")


class Recording(PopulationPolicy):
    name = "recording"

    def __init__(self, every: int) -> None:
        self.every = every
        self.steps: list[int] = []

    def _step(self, comm, iteration, is_due, model, optimizer, local_metric):
        self.steps.append(iteration)
        return model, optimizer, PolicyInfo(iteration, self.name, acted=is_due)


POLICIES = [lambda: AverageAll(5), lambda: SelectiveAveraging(5), lambda: OneSidedAveraging(5),
            lambda: AsyncSelectiveAveraging(5)]


@pytest.mark.parametrize("make", POLICIES)
def test_every_policy_shares_the_prologue(make):
    policy = make()
    model = torch.nn.Linear(2, 2)
    out, opt, info = policy(3, model, None, 1.0)  # not a decision point
    assert out is model and opt is None and not info.acted
    out, _, info = policy(5, model, None, 1.0)  # a decision point in a group of one: nothing to do
    assert out is model and info.acted and info.summary == "a group of one" and not info.replaced
    assert info.averaged == isinstance(policy, AverageAll)
    with pytest.raises(ConfigError, match="iteration must be a non-negative int"):
        policy(-1, model, None, 1.0)


@pytest.mark.parametrize("make", POLICIES[1:])
def test_a_decision_point_needs_a_metric_even_alone(make):
    with pytest.raises(ConfigError, match="pass local_metric"):
        make()(0, torch.nn.Linear(2, 2), None, None)


def test_average_all_needs_no_metric():
    assert AverageAll(1)(0, torch.nn.Linear(2, 2))[2].averaged


def test_a_group_of_one_never_reaches_the_policy_step():
    policy = Recording(2)
    for iteration in range(6):
        policy(iteration, object(), None, 0.5)
    assert policy.steps == []
