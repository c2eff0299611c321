"""Pure tests of PB2's model-based explore step (popmesh.population.pb2_explore): bounds, determinism,
pending members, the fallback to the plain explore step, and that the model finds the better region
of a closed-form landscape."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from popmesh.core.errors import ConfigError
from popmesh.population import PB2, Categorical, Continuous, Integer, Observation, explore, pb2_explore
from popmesh.population.decisions import pb2 as pb2_module

SPACE = {
    "lr": Continuous(1e-5, 1e-1, log=True),
    "clip": Continuous(0.05, 0.5),
    "batch": Integer(16, 512, log=True),
    "epochs": Integer(1, 10),
    "optimizer": Categorical(["sgd", "adam", "adamw"]),
}
START = {"lr": 1e-3, "clip": 0.2, "batch": 64, "epochs": 4, "optimizer": "adam"}
MODELLED = ("lr", "clip", "batch", "epochs")
MEMBERS = 8  # members per round; every round is one interval of STEPS
STEPS = 100.0


def landscape(hp, peak=-2.0):
    """The change over one interval: highest at log10(lr) = peak, a little better at clip 0.3."""
    return -((math.log10(hp["lr"]) - peak) ** 2) - 2.0 * (hp["clip"] - 0.3) ** 2


def history(rounds, seed, peak=lambda r: -2.0, noise=0.1, space=SPACE):
    """``rounds`` rounds of MEMBERS intervals each, hyper-parameters drawn from ``space``."""
    gen = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        for _ in range(MEMBERS):
            hp = {k: e.sample(gen) for k, e in space.items()}
            change = landscape(hp, peak(r)) + gen.normal(0.0, noise)
            out.append(Observation(r * STEPS, (r + 1) * STEPS, hp, change))
    return out


def clock_after(observations):
    return max(o.end for o in observations)


def inside(value, entry):
    return entry.low <= value <= entry.high


# ---------------------------------------------------------------- bounds, types, determinism

@pytest.mark.parametrize("seed", range(4))
def test_suggestions_lie_within_bounds_and_integers_stay_ints(seed):
    obs = history(6, seed)
    out = pb2_explore(START, SPACE, obs, clock_after(obs), seed)
    assert list(out) == list(START)
    for key in MODELLED:
        assert inside(out[key], SPACE[key]), (key, out[key])
    assert type(out["batch"]) is int and type(out["epochs"]) is int
    assert type(out["lr"]) is float and type(out["clip"]) is float


def test_a_best_region_at_a_bound_gives_the_bound_itself():
    space = {"clip": Continuous(0.05, 0.5), "epochs": Integer(1, 10)}
    gen = np.random.default_rng(0)
    obs = []
    for i in range(40):
        hp = {"clip": space["clip"].sample(gen), "epochs": space["epochs"].sample(gen)}
        obs.append(Observation(i * 10.0, i * 10.0 + 10.0, hp, 5.0 * hp["clip"] + hp["epochs"]))
    out = pb2_explore({"clip": 0.2, "epochs": 3}, space, obs, 400.0, 1, options=PB2(kappa=0.0))
    assert out["clip"] == pytest.approx(0.5, abs=0.02) and out["clip"] <= 0.5
    assert out["epochs"] == 10


def test_same_inputs_and_seed_give_the_same_suggestion():
    obs = history(5, 7)
    clock = clock_after(obs)
    first = pb2_explore(START, SPACE, obs, clock, 11)
    assert pb2_explore(START, SPACE, obs, clock, 11) == first
    assert pb2_explore(START, SPACE, obs, clock, np.random.default_rng(11)) == first
    assert pb2_explore(START, SPACE, obs, clock, 12)["lr"] != first["lr"]


def test_changes_are_modelled_per_unit_of_clock():
    """Clocks and changes twice as large are the same rates at the same scaled times."""
    obs = history(5, 3)
    doubled = [Observation(2 * o.start, 2 * o.end, o.hparams, 2 * o.change) for o in obs]
    assert (pb2_explore(START, SPACE, doubled, 2 * clock_after(obs), 4)
            == pb2_explore(START, SPACE, obs, clock_after(obs), 4))


def test_long_intervals_do_not_pass_for_fast_progress():
    """The rate peaks at lr = 1e-2, but members far from it ran intervals eight times as long and so
    gained more in all: the suggestion follows the rate."""
    space = {"lr": SPACE["lr"]}
    gen = np.random.default_rng(4)
    obs = []
    for i in range(48):
        hp = {"lr": space["lr"].sample(gen)}
        gap = abs(math.log10(hp["lr"]) + 2.0)
        length = 400.0 if gap > 1.5 else 50.0
        obs.append(Observation(i * 10.0, i * 10.0 + length, hp, (3.0 - 0.5 * gap**2) * length))
    for seed in range(3):
        out = pb2_explore({"lr": 1e-3}, space, obs, 900.0, seed)
        assert abs(math.log10(out["lr"]) + 2.0) < 0.75, out


# ---------------------------------------------------------------- pending members

def test_pending_members_move_the_next_suggestion():
    obs = history(6, 2)
    clock = clock_after(obs)
    first = pb2_explore(START, SPACE, obs, clock, 5)
    second = pb2_explore(START, SPACE, obs, clock, 5, pending=[first])
    other = pb2_explore(START, SPACE, obs, clock, 5, pending=[START])
    modelled = [lambda hp, k=k: hp[k] for k in ("lr", "clip")]
    assert [f(second) for f in modelled] != [f(first) for f in modelled]
    assert [f(second) for f in modelled] != [f(other) for f in modelled]
    assert second["optimizer"] == first["optimizer"]  # the plain explore step draws the same


def test_a_batch_of_suggestions_spreads_out():
    obs = history(6, 9)
    clock = clock_after(obs)
    batch = []
    for _ in range(4):
        batch.append(pb2_explore(START, SPACE, obs, clock, 3, pending=batch))
    assert len({(hp["lr"], hp["clip"]) for hp in batch}) == 4


# ---------------------------------------------------------------- fallback and other keys

@pytest.mark.parametrize("observations", [
    [],
    [Observation(0.0, 10.0, START, 1.0)],
    [Observation(0.0, 10.0, START, 1.0), Observation(0.0, 10.0, {**START, "lr": 1e-2}, 1.0)],
], ids=["none", "one", "equal-changes"])
def test_too_little_data_falls_back_to_the_plain_explore_step(observations):
    for seed in range(5):
        out = pb2_explore(START, SPACE, observations, 10.0, seed, perturb=(0.5, 2.0), resample_prob=0.1)
        assert out == explore(START, seed, (0.5, 2.0), 0.1, SPACE)


def test_non_numeric_and_undeclared_keys_go_through_the_plain_explore_step():
    space = {**SPACE, "layers": [1, 2, 3]}
    hparams = {**START, "layers": 2, "gamma": 0.99, "name": "ppo"}
    obs = [Observation(o.start, o.end, {**o.hparams, "layers": 2}, o.change) for o in history(4, 1)]
    rest = {k: v for k, v in hparams.items() if k not in MODELLED}
    rest_space = {k: v for k, v in space.items() if k not in MODELLED}
    for seed in range(5):
        out = pb2_explore(hparams, space, obs, clock_after(obs), seed, resample_prob=0.0)
        assert {k: out[k] for k in rest} == explore(rest, seed, (0.8, 1.2), 0.0, rest_space)
        assert out["optimizer"] in ("sgd", "adamw")  # a neighbour of "adam"
        assert out["gamma"] in (pytest.approx(0.792), pytest.approx(1.188)) and out["name"] == "ppo"


def test_a_space_without_bounded_keys_is_the_plain_explore_step():
    space = {"optimizer": SPACE["optimizer"]}
    obs = history(3, 0)
    assert pb2_explore(START, space, obs, 300.0, 2) == explore(START, 2, space=space)


# ---------------------------------------------------------------- the model finds the better region

def test_the_model_finds_the_better_learning_rate():
    """Change peaks at lr = 1e-2 on a log scale: every suggestion lies nearer to it than half the
    random draws from the declaration (the median random draw is a decade away)."""
    gen = np.random.default_rng(0)
    random_gap = np.median([abs(math.log10(SPACE["lr"].sample(gen)) + 2.0) for _ in range(2000)])
    gaps = []
    for seed in range(5):
        obs = history(6, 100 + seed)
        out = pb2_explore(START, SPACE, obs, clock_after(obs), seed)
        gaps.append(abs(math.log10(out["lr"]) + 2.0))
    assert max(gaps) < random_gap, (gaps, random_gap)
    assert np.mean(gaps) < 0.5 * random_gap, (gaps, random_gap)


def test_recent_intervals_outweigh_old_ones_when_the_landscape_moves():
    """The best lr moves from 1e-4 to 1e-2 halfway: the suggestion at the end follows the recent
    intervals, with the whole history in the window."""
    hits = 0
    for seed in range(4):
        obs = history(10, 200 + seed, peak=lambda r: -4.0 if r < 5 else -2.0)
        out = pb2_explore(START, SPACE, obs, clock_after(obs), seed)
        hits += abs(math.log10(out["lr"]) + 2.0) < abs(math.log10(out["lr"]) + 4.0)
    assert hits >= 3


def test_window_keeps_only_the_latest_observations():
    old = history(4, 5, peak=lambda r: -4.0)
    new = [Observation(o.start + 400.0, o.end + 400.0, o.hparams, o.change) for o in history(4, 6)]
    out = pb2_explore(START, SPACE, new + old, 800.0, 0, options=PB2(window=len(new)))
    assert out == pb2_explore(START, SPACE, new, 800.0, 0, options=PB2(window=len(new)))


# ---------------------------------------------------------------- configuration errors

def raises(match, *args, **kwargs):
    with pytest.raises(ConfigError, match=match):
        pb2_explore(*args, **kwargs)


def test_hparams_must_hold_every_space_key_within_its_declaration():
    obs = history(2, 0)
    raises(r"space names hyper-parameters \['lr'\] that hparams lacks",
           {k: v for k, v in START.items() if k != "lr"}, SPACE, obs, 200.0, 0)
    raises(r"'lr' = 1.0 lies outside its declared bounds \[1e-05, 0.1\]: start it inside them",
           {**START, "lr": 1.0}, SPACE, obs, 200.0, 0)
    raises(r"clock must be a finite number", START, SPACE, obs, math.nan, 0)
    raises(r"options must be a PB2", START, SPACE, obs, 200.0, 0, options={"window": 10})


def test_observations_are_checked_and_named():
    obs = history(2, 0)
    lacking = {k: v for k, v in obs[1].hparams.items() if k != "clip"}
    raises(r"observations\[1\]\.hparams lacks the modelled hyper-parameter 'clip': record every",
           START, SPACE, [obs[0], obs[1]._replace(hparams=lacking)], 200.0, 0)
    raises(r"observations\[0\] runs from 5.0 to 5.0: an interval needs finite clocks with end > start",
           START, SPACE, [obs[0]._replace(start=5.0, end=5.0)], 200.0, 0)
    raises(r"observations\[0\] runs from 9.0 to 3.0", START, SPACE, [obs[0]._replace(start=9.0, end=3.0)], 200.0, 0)
    raises(r"observations\[2\] has change = nan: give a finite objective change",
           START, SPACE, [obs[0], obs[1], obs[2]._replace(change=math.nan)], 200.0, 0)
    raises(r"observations\[0\]\.hparams\['lr'\] = 0.5 is not a number within its declared bounds",
           START, SPACE, [obs[0]._replace(hparams={**obs[0].hparams, "lr": 0.5})], 200.0, 0)
    raises(r"observations\[0\] must be an Observation", START, SPACE, [(0.0, 1.0, START, 1.0)], 200.0, 0)


def test_pending_members_are_checked_and_named():
    obs = history(2, 0)
    raises(r"pending\[1\] lacks the modelled hyper-parameter 'batch'",
           START, SPACE, obs, 200.0, 0, pending=[START, {k: v for k, v in START.items() if k != "batch"}])


@pytest.mark.parametrize(("field", "value", "match"), [
    ("window", 1, r"PB2 window must be an int >= 2, got 1"),
    ("candidates", 0, r"PB2 candidates must be an int >= 1"),
    ("restarts", -1, r"PB2 restarts must be an int >= 0"),
    ("kappa", -0.5, r"PB2 kappa must be a finite number >= 0.0, got -0.5: or None"),
    ("beta_offset", -0.1, r"PB2 beta_offset must be a finite number >= 0.0.*Ray's PB2 uses 0.2"),
    ("beta_growth", math.inf, r"PB2 beta_growth must be a finite number > 0.0"),
    ("pending_noise", math.nan, r"PB2 pending_noise must be a finite number >= 0.0"),
])
def test_options_are_checked(field, value, match):
    with pytest.raises(ConfigError, match=match):
        PB2(**{field: value})


def test_ucb_weight_follows_the_gp_ucb_schedule():
    assert PB2().ucb_weight(200) == pytest.approx(math.sqrt(0.2 + math.log(0.4 * 200)))
    assert PB2().ucb_weight(2) == pytest.approx(math.sqrt(0.2))  # log(0.8) < 0 counts as 0
    assert PB2(kappa=1.5).ucb_weight(200) == 1.5


def test_missing_scikit_learn_gives_the_install_hint(monkeypatch):
    for name in ("sklearn", "sklearn.gaussian_process", "sklearn.gaussian_process.kernels"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"^PB2 needs scikit-learn: pip install 'popmesh\[pb2\]'$") as info:
        pb2_explore(START, SPACE, [], 0.0, 0)
    assert isinstance(info.value.__cause__, ImportError)


def test_names_are_exported():
    from popmesh.population import decisions

    for name in ("PB2", "Observation", "pb2_explore"):
        assert name in pb2_module.__all__
        assert getattr(decisions, name) is getattr(pb2_module, name)
