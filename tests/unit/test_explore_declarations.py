"""Pure tests of the typed hyper-parameter declarations of popmesh.population.explore (Ray Tune's
``hyperparam_mutations`` semantics: continuous, log-scale, integer, categorical)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.population import Categorical, Continuous, Explore, Integer, explore, sample_hparams

SPACE = {
    "lr": Continuous(1e-5, 1e-1, log=True),
    "clip": Continuous(0.05, 0.5),
    "batch": Integer(16, 512, log=True),
    "epochs": Integer(1, 10),
    "optimizer": Categorical(["sgd", "adam", "adamw"]),
}
START = {"lr": 1e-3, "clip": 0.2, "batch": 64, "epochs": 4, "optimizer": "adam"}


def perturbed(hparams, seed, space=SPACE, **kwargs):
    """explore with no resampling, over the declarations of ``hparams``' keys."""
    return explore(hparams, seed, resample_prob=0.0, space={k: space[k] for k in hparams if k in space}, **kwargs)


def resampled(key, value, seed, space=SPACE):
    return explore({key: value}, seed, resample_prob=1.0, space={key: space[key]})[key]


# ---------------------------------------------------------------- continuous

def test_continuous_perturbs_by_a_factor_and_clips_to_the_bounds():
    outs = sorted({round(perturbed({"clip": 0.2}, s)["clip"], 12) for s in range(30)})
    assert outs == [0.16, 0.24]
    top = sorted({round(perturbed({"clip": 0.5}, s)["clip"], 12) for s in range(30)})
    assert top == [0.4, 0.5]  # 0.6 clipped to the high bound, as Ray clips it


def test_continuous_resamples_within_bounds_linear_and_log():
    lin = [resampled("clip", 0.2, s) for s in range(400)]
    assert all(0.05 <= x <= 0.5 for x in lin) and np.mean(lin) == pytest.approx(0.275, abs=0.03)
    logs = [resampled("lr", 1e-3, s) for s in range(400)]
    assert all(1e-5 <= x <= 1e-1 for x in logs)
    decades = np.log10(logs)
    assert np.mean(decades) == pytest.approx(-3.0, abs=0.25)  # log-uniform: decades equally likely
    assert min(decades) < -4.5 and max(decades) > -1.5


# ---------------------------------------------------------------- integer

def test_integers_move_by_at_least_one_and_stay_ints():
    for space in ({"n": Integer(0, 100)}, {"n": Integer(1, 100, log=True)}):
        outs = [perturbed({"n": 2}, s, space=space)["n"] for s in range(40)]
        assert set(outs) == {1, 3} and all(type(x) is int for x in outs)
    big = {perturbed({"n": 50}, s, space={"n": Integer(0, 100)})["n"] for s in range(40)}
    assert big == {40, 60}


def test_integer_perturbation_clips_at_the_bounds():
    outs = {perturbed({"n": 10}, s, space={"n": Integer(1, 10)})["n"] for s in range(40)}
    assert outs == {8, 10}


def test_integer_resample_includes_both_bounds():
    outs = {explore({"n": 2}, s, resample_prob=1.0, space={"n": Integer(1, 3)})["n"] for s in range(60)}
    assert outs == {1, 2, 3}
    logs = [explore({"n": 16}, s, resample_prob=1.0, space={"n": Integer(16, 512, log=True)})["n"] for s in range(300)]
    assert all(16 <= x <= 512 and type(x) is int for x in logs) and max(logs) > 256 and min(logs) < 32


# ---------------------------------------------------------------- categorical

def test_categorical_steps_to_a_neighbour():
    outs = {perturbed({"optimizer": "adam"}, s)["optimizer"] for s in range(40)}
    assert outs == {"sgd", "adamw"}


@pytest.mark.parametrize("value, neighbour", [("sgd", "adam"), ("adamw", "adam")])
def test_categorical_at_an_end_moves_to_its_only_neighbour(value, neighbour):
    assert {perturbed({"optimizer": value}, s)["optimizer"] for s in range(40)} == {neighbour}


def test_a_single_choice_stays_and_resampling_draws_any_choice():
    assert perturbed({"opt": "sgd"}, 0, space={"opt": Categorical(["sgd"])}) == {"opt": "sgd"}
    outs = {resampled("optimizer", "adam", s) for s in range(60)}
    assert outs == {"sgd", "adam", "adamw"}


# ---------------------------------------------------------------- together

def test_a_seeded_draw_is_reproducible():
    a = explore(START, 7, space=SPACE)
    assert a == explore(START, 7, space=SPACE) == explore(START, np.random.default_rng(7), space=SPACE)
    assert any(explore(START, s, space=SPACE) != a for s in range(8, 12))
    assert START == {"lr": 1e-3, "clip": 0.2, "batch": 64, "epochs": 4, "optimizer": "adam"}
    assert sample_hparams(SPACE, 3) == sample_hparams(SPACE, 3)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), prob=st.floats(0, 1), steps=st.integers(1, 6))
def test_every_explored_value_stays_declared(seed, prob, steps):
    hp = dict(START)
    for step in range(steps):
        hp = explore(hp, np.random.default_rng([seed, step]), resample_prob=prob, space=SPACE)
        for key, declaration in SPACE.items():
            declaration.check(key, hp[key])


def test_sample_hparams_draws_inside_each_declaration():
    drawn = sample_hparams(SPACE, 0)
    assert list(drawn) == list(SPACE)
    for key, declaration in SPACE.items():
        declaration.check(key, drawn[key])
    with pytest.raises(ConfigError, match="declarations only"):
        sample_hparams({"lr": [0.1, 0.01]}, 0)


def test_undeclared_keys_keep_the_untyped_rules():
    out = perturbed({"lr": 1e-3, "gamma": 0.99, "name": "x"}, 0, space={"lr": SPACE["lr"]})
    assert out["name"] == "x" and out["gamma"] in (pytest.approx(0.792), pytest.approx(1.188))


def test_explore_on_an_optimizer_with_a_declared_learning_rate():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.09)
    rule = Explore(space={"lr": Continuous(1e-5, 1e-1, log=True)}, resample_prob=0.0)
    changes = [rule.apply(opt, seed=0, iteration=i, rank=0)["lr"] for i in range(10)]
    assert all(1e-5 <= new <= 1e-1 for _, new in changes)
    assert any(new == 1e-1 for _, new in changes)  # 0.09 or 0.072 times 1.2 clipped at the bound


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("make, match", [
    (lambda: Continuous(1.0, 1.0), "low < high"),
    (lambda: Continuous(0.0, math.inf), "finite bounds"),
    (lambda: Continuous(0.0, 1.0, log=True), "positive low bound"),
    (lambda: Continuous(-1e-3, 1.0, log=True), "positive low bound"),
    (lambda: Integer(0, 64, log=True), "positive low bound"),
    (lambda: Integer(1.5, 4), "low < high"),
    (lambda: Integer(4, 2), "low < high"),
    (lambda: Categorical([]), "non-empty"),
    (lambda: Categorical("abc"), "non-empty"),
    (lambda: Categorical(["a", "b", "a"]), "distinct"),
])
def test_bad_declarations(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("hparams, space, match", [
    ({"lr": 0.5}, {"lr": Continuous(1e-5, 1e-1)}, r"'lr' = 0.5 lies outside its declared bounds \[1e-05, 0.1\]"),
    ({"n": 0}, {"n": Integer(1, 10)}, "'n' = 0 lies outside"),
    ({"n": 2.0}, {"n": Integer(1, 10)}, "declared Integer"),
    ({"lr": "fast"}, {"lr": Continuous(0.0, 1.0)}, "declared Continuous"),
    ({"lr": math.nan}, {"lr": Continuous(0.0, 1.0)}, "declared Continuous"),
    ({"opt": "lamb"}, {"opt": Categorical(["sgd", "adam"])}, "'lamb' is not one of its choices"),
    ({"lr": 0.1}, {"momentum": Continuous(0.0, 1.0)}, r"\['momentum'\] that hparams lacks"),
])
def test_bad_values_against_their_declarations(hparams, space, match):
    with pytest.raises(ConfigError, match=match):
        explore(hparams, 0, space=space)


def test_explore_options_reject_a_space_outside_their_keys():
    with pytest.raises(ConfigError, match=r"space names \['gamma'\], which are not among keys \['lr'\]"):
        Explore(space={"gamma": Continuous(0.9, 0.999)})
    with pytest.raises(ConfigError, match="outside its declared bounds"):
        Explore(space={"lr": Continuous(1e-5, 1e-3)}).apply(
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5), 0, 0, 0)
