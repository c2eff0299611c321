"""Explored hyper-parameters as they travel, without processes: read from the optimizer and the loop,
encoded into a report and back, assigned to a replaced agent (its donor's values, explored), the
reference agent and the true objective in the latest decider."""

import json
import math

import pytest
import torch

from popmesh import ConfigError
from popmesh.population import AsyncSelectiveAveraging, Categorical, Continuous, Explore, Integer, LatestRules
from popmesh.population.decisions.hparams import assign, current_values, decode, encode
from popmesh.population.decisions.latest import Report, init_latest, judge
from popmesh.population.decisions.options import SelectiveOptions
from popmesh.population.mechanisms.asynchronous.deciders import LatestDecider
from popmesh.population.mechanisms.asynchronous.protocol import METRIC, Up, parse_up, up_row

SPACE = {"lr": Continuous(1e-5, 1e-1, log=True), "ent": Continuous(1e-4, 1e-1, log=True),
         "batch": Integer(32, 512, log=True), "act": Categorical(["tanh", "relu", ("gelu", 1)])}
EXPLORE = Explore(keys=("lr", "ent", "batch", "act"), space=SPACE)


def adam(lr=1e-3):
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_values_come_from_the_param_groups_then_from_the_loop():
    values = current_values(EXPLORE, adam(3e-3), {"ent": 0.01, "batch": 64, "act": "relu"})
    assert values == {"lr": 3e-3, "ent": 0.01, "batch": 64, "act": "relu"}


@pytest.mark.parametrize("given, words", [
    ({"ent": 0.01, "batch": 64}, "'act' is neither an optimizer param-group field"),
    ({"ent": 0.01, "batch": 64, "act": "relu", "gamma": 0.99}, "hparams= names ['gamma']"),
    ({"ent": 0.5, "batch": 64, "act": "relu"}, "'ent' = 0.5 lies outside its declared bounds"),
    ({"ent": 0.01, "batch": 64, "act": "swish"}, "'act' = 'swish' is not one of its choices"),
    ({"ent": 0.01, "batch": 64.0, "act": "relu"}, "'batch' is declared Integer"),
])
def test_unknown_names_and_values_outside_their_declarations_are_refused(given, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        current_values(EXPLORE, adam(), given)


def test_encoded_values_come_back_with_their_types_through_an_up_row():
    values = {"lr": 3e-3, "ent": 0.01, "batch": 64, "act": ("gelu", 1)}
    up = parse_up(up_row(METRIC, 10, 1.5, 7, -1, 640, 2, 0.25, encode(EXPLORE, values)))
    assert (up.objective, up.generation) == (0.25, 2)
    back = decode(EXPLORE, up.hparams)
    assert back == values and type(back["batch"]) is int and type(back["lr"]) is float
    assert decode(EXPLORE, json.loads(json.dumps(encode(EXPLORE, values).tolist()))) == values
    flags = Explore(keys=("nesterov",))
    assert decode(flags, encode(flags, {"nesterov": True})) == {"nesterov": True}
    with pytest.raises(ConfigError, match="declare its values"):
        encode(Explore(keys=("opt",)), {"opt": "adam"})
    with pytest.raises(ConfigError, match="every rank must explore the same keys"):
        decode(EXPLORE, [0.0, 1.0])


def test_a_replaced_agent_starts_from_its_donors_values_explored_within_bounds_and_reproducibly():
    donor = {"lr": 0.09, "ent": 0.01, "batch": 500, "act": "tanh"}
    runs = [assign(donor, EXPLORE, 3, 40, 2) for _ in range(2)]
    assert runs[0] == runs[1], "seeded by (seed, iteration, rank)"
    drawn = [assign(donor, EXPLORE, 3, it, 2) for it in range(60)]
    assert all(SPACE["lr"].low <= d["lr"] <= SPACE["lr"].high for d in drawn)
    assert all(32 <= d["batch"] <= 512 and isinstance(d["batch"], int) for d in drawn)
    assert {d["act"] for d in drawn} <= {"tanh", "relu", ("gelu", 1)} and len({d["lr"] for d in drawn}) > 5
    moved = [d for d in drawn if d["lr"] in (donor["lr"] * 0.8, SPACE["lr"].high)]
    assert len(moved) > 20, "mostly the perturbation of the donor's value, clipped to the bounds"
    assert assign(donor, None, 3, 40, 2) == donor, "no explore step: the donor's values as they are"


def test_the_reference_agent_is_never_replaced_compared_or_a_donor():
    reports = [Report(0, 10, 10, 9.0), Report(1, 10, 10, 1.0), Report(2, 10, 10, 5.0), Report(3, 10, 10, 0.5)]
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, quantile_fraction=0.5)
    verdict, _ = judge(3, reports, init_latest(4), rules, reference=[0])
    assert verdict.replace and verdict.donors == (2,) and 0 not in verdict.objectives
    verdict, _ = judge(1, reports, init_latest(4), rules, reference=[1])
    assert not verdict.replace and "reference agent" in verdict.reason


def book_report(iteration, metric, *, objective=math.nan, hparams=(), generation=0):
    return Up(METRIC, iteration, float(metric), 7, -1, iteration, generation, objective, tuple(hparams))


def test_the_decider_ranks_by_the_objective_and_sends_the_replaced_rank_its_values():
    explore = Explore(keys=("lr", "ent"), space={"lr": Continuous(1e-5, 1e-1, log=True),
                                                 "ent": Continuous(1e-4, 1e-1, log=True)})
    options = SelectiveOptions(10, explore=explore, seed=5)
    decider = LatestDecider(3, options, LatestRules(relative_gap=0.0, absolute_gap=0.0))
    mine = {"lr": 1e-3, "ent": 1e-3}
    best = {"lr": 2e-2, "ent": 5e-3}
    decider.record(1, book_report(10, 0.0, objective=9.0, hparams=encode(explore, best)), 0.0)
    decider.record(0, book_report(10, 99.0, objective=1.0, hparams=encode(explore, mine)), 0.0)
    (dispatch,) = decider.ready()
    assert dispatch.replaced == (0,), "the training metric (99) would keep rank 0; the objective (1) replaces it"
    message = dispatch.messages[0]
    assert decode(explore, message["inherited"]) == best
    assert decode(explore, message["hparams"]) == assign(best, explore, 5, 10, 0)
    assert "hparams" not in dispatch.messages.get(1, {}), "a donor is sent no values"


def test_the_policy_refuses_what_only_the_latest_decisions_do():
    pb2_free = Explore(keys=("lr",))
    with pytest.raises(ConfigError, match="reference= needs decide='latest'"):
        AsyncSelectiveAveraging(10, decide="complete", reference=0)
    with pytest.raises(ConfigError, match="reference must be a global rank"):
        AsyncSelectiveAveraging(10, reference=-1)
    policy = AsyncSelectiveAveraging(10, decide="complete", explore=pb2_free)
    with pytest.raises(ConfigError, match="decide='latest' only"):
        policy(0, torch.nn.Linear(2, 2), None, 1.0, objective=2.0)


def test_the_events_line_keeps_the_explored_values():
    from popmesh.population.mechanisms.events import replacement_event

    record = replacement_event("async_selective", 12, 10, 3, [0], [1.0], {0: 9.0, 3: 1.0}, "mean", "reset",
                               hparams={"lr": [1e-3, 2.4e-2], "act": ["tanh", ("gelu", 1)]},
                               inherited={"lr": 2e-2, "act": "relu"})
    assert json.loads(json.dumps(record))["hparams"] == {"lr": [1e-3, 2.4e-2], "act": ["tanh", ["gelu", 1]]}
    assert record["inherited"] == {"lr": 2e-2, "act": "relu"}
    assert "hparams" not in replacement_event("selective", 1, 1, 0, [1], [1.0], {}, "mean", "reset")
