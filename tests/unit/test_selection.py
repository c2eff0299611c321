"""Unit tests for the pure population-policy core: selection, donors, weights, combination, decisions."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.population import (
    DEFAULT_OPTIMIZER_POLICY,
    Decision,
    DonorRule,
    OptimizerPolicy,
    ReplacementRule,
    Strategy,
    apply_momentum,
    averaging_weights,
    below_threshold,
    combine,
    combine_rules,
    decide,
    donors_all_others,
    donors_best_k,
    donors_random,
    due_by_age,
    explore,
    init_ages,
    init_state,
    optimizer_action,
    order_worst_first,
    rank_weights,
    select_donors,
    step_ages,
    update_state,
    worst_by_ratio,
)

NAN, INF = float("nan"), float("inf")
FAST = settings(max_examples=60, deadline=None)
metric = st.one_of(st.floats(-1e6, 1e6), st.sampled_from([NAN, INF, -INF]))
metric_lists = st.lists(metric, min_size=1, max_size=12)


def _key(x: float) -> float:
    return x if math.isfinite(x) else -INF


# ---------------------------------------------------------------- who is replaced

def test_worst_by_ratio_picks_lowest_and_returns_ascending_ranks():
    assert worst_by_ratio([5.0, 1.0, 3.0, 0.0, 4.0], 0.4) == [1, 3]


def test_worst_by_ratio_k_rule_and_float_slack():
    assert len(worst_by_ratio(list(range(100)), 0.29)) == 29      # int(100 * 0.29) would give 28
    assert len(worst_by_ratio([1.0, 2.0, 3.0], 0.01)) == 1         # at least one
    assert len(worst_by_ratio([1.0, 2.0, 3.0], 0.99)) == 2         # at most n - 1
    assert worst_by_ratio([7.0], 0.5) == []                        # a population of one survives


def test_worst_by_ratio_ties_replace_higher_rank_first():
    assert worst_by_ratio([1.0, 1.0, 1.0, 1.0], 0.5) == [2, 3]
    assert order_worst_first([2.0, 1.0, 1.0, 2.0]) == [2, 1, 3, 0]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_metrics_count_as_worst(bad):
    assert worst_by_ratio([-1e9, bad, 0.0, 3.0], 0.25) == [1]


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, NAN, True, "0.2"])
def test_worst_by_ratio_rejects_bad_ratio(ratio):
    with pytest.raises(ConfigError, match="open interval"):
        worst_by_ratio([1.0, 2.0], ratio)


@pytest.mark.parametrize("bad", [[], [[1.0, 2.0]]])
def test_metrics_must_be_flat_and_non_empty(bad):
    with pytest.raises(ConfigError, match="metrics"):
        worst_by_ratio(bad, 0.5)


@FAST
@given(metric_lists, st.floats(0.01, 0.99))
def test_worst_by_ratio_properties(metrics, ratio):
    out = worst_by_ratio(metrics, ratio)
    n = len(metrics)
    assert len(out) == min(max(1, math.floor(n * ratio + 1e-9)), n - 1)
    assert out == sorted(set(out))
    kept = [r for r in range(n) if r not in out]
    for r in out:
        for s in kept:
            assert (_key(metrics[r]), -r) < (_key(metrics[s]), -s)


def test_below_threshold_with_cooldown():
    metrics = [0.1, 0.9, 0.2, 0.05]
    assert below_threshold(metrics, 0.5) == [0, 2, 3]
    last = [8, None, 5, None]
    assert below_threshold(metrics, 0.5, last, iteration=10, cooldown=5) == [2, 3]   # 10 - 5 >= 5
    assert below_threshold(metrics, 0.5, {0: 8, 2: 6}, iteration=10, cooldown=5) == [3]
    assert below_threshold(metrics, 0.5, last, iteration=10, cooldown=0) == [0, 2, 3]


def test_below_threshold_never_replaces_everyone_and_counts_nan_below():
    assert below_threshold([NAN, 1.0, 2.0], 10.0) == [0, 1]
    assert below_threshold([NAN, NAN], 0.0) == [1]
    assert below_threshold([3.0, 4.0], 0.0) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(threshold=NAN), "threshold"),
    (dict(threshold=0.5, cooldown=-1), "cooldown"),
    (dict(threshold=0.5, cooldown=3, last_replaced=[1, None, None]), "iteration"),
    (dict(threshold=0.5, last_replaced=[1, None]), "last_replaced"),
    (dict(threshold=0.5, last_replaced={7: 1}), "outside"),
])
def test_below_threshold_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        below_threshold([0.1, 0.2, 0.3], **kwargs)


def test_age_rule_lifetimes_in_range_and_redrawn():
    state = init_ages(6, (2, 4), rng=7)
    assert state.ages == (0,) * 6 and all(2 <= x <= 4 for x in state.lifetimes)
    for _ in range(4):
        due = due_by_age(state)
        assert all(state.ages[r] >= state.lifetimes[r] for r in due)
        state = step_ages(state, due)
    assert all(a <= life for a, life in zip(state.ages, state.lifetimes))
    assert max(state.generations) >= 1
    replaced_once = [r for r, g in enumerate(state.generations) if g > 0]
    assert all(state.ages[r] <= 4 for r in replaced_once)


def test_age_lifetimes_do_not_depend_on_other_agents():
    a = step_ages(step_ages(init_ages(3, (1, 100), rng=3), [0]), [0, 1])
    b = step_ages(step_ages(init_ages(3, (1, 100), rng=3), [0, 2]), [0])
    assert a.lifetimes[0] == b.lifetimes[0] and a.generations[0] == b.generations[0] == 2
    assert a.ages == (0, 0, 2) and b.ages == (0, 2, 1)


def test_age_rule_seed_and_generator_are_deterministic():
    assert init_ages(5, (1, 50), 11) == init_ages(5, (1, 50), 11)
    g1, g2 = np.random.default_rng(4), np.random.default_rng(4)
    assert init_ages(5, (1, 50), g1) == init_ages(5, (1, 50), g2)


@pytest.mark.parametrize("age_range", [(0, 3), (5, 2), (1.5, 3), (1,), "ab", None])
def test_bad_age_range(age_range):
    with pytest.raises(ConfigError, match="age_range"):
        init_ages(3, age_range, 0)


def test_init_ages_needs_agents_and_rng():
    with pytest.raises(ConfigError, match="positive"):
        init_ages(0, (1, 2), 0)
    with pytest.raises(ConfigError, match="rng"):
        init_ages(2, (1, 2), None)
    with pytest.raises(ConfigError, match="outside"):
        step_ages(init_ages(2, (1, 2), 0), [2])


def test_replacement_rule_validation():
    with pytest.raises(ConfigError, match="at least one"):
        ReplacementRule()
    with pytest.raises(ConfigError, match="ratio"):
        ReplacementRule(ratio=1.0)
    with pytest.raises(ConfigError, match="mode"):
        ReplacementRule(ratio=0.5, mode="some")
    with pytest.raises(ConfigError, match="age_range"):
        ReplacementRule(age_range=(3, 1))
    with pytest.warns(UserWarning, match="cooldown"):
        ReplacementRule(ratio=0.5, cooldown=3)
    assert ReplacementRule(age_range=[2.0, 5]).age_range == (2, 5)


def test_combine_rules_any_all_and_reasons():
    metrics = [0.0, 1.0, 2.0, 3.0]
    any_rule = ReplacementRule(ratio=0.25, threshold=1.5)
    picked, why = combine_rules(metrics, any_rule)
    assert picked == [0, 1]
    assert "worst 1 of 4" in why[0] and "below threshold" in why[0] and "worst" not in why[1]
    all_rule = ReplacementRule(ratio=0.25, threshold=1.5, mode="all")
    assert combine_rules(metrics, all_rule)[0] == [0]


def test_combine_rules_age_needs_state_and_keeps_one_agent():
    rule = ReplacementRule(age_range=(1, 1))
    with pytest.raises(ConfigError, match="init_state"):
        combine_rules([1.0, 2.0], rule)
    state = init_state(3, rule, rng=0)
    state = update_state(state, [], iteration=0)                 # everyone reaches age 1 = lifetime
    picked, why = combine_rules([1.0, 3.0, 2.0], rule, state=state)
    assert picked == [0, 2] and why[0] == "age 1 reached lifetime 1"
    with pytest.raises(ConfigError, match="tracks 3 agents"):
        combine_rules([1.0, 2.0], rule, state=state)


def test_update_state_records_iteration_and_ages():
    rule = ReplacementRule(threshold=0.5, cooldown=2, age_range=(3, 3))
    state = update_state(init_state(3, rule, rng=1), [1], iteration=4)
    assert state.last_replaced == (None, 4, None)
    assert state.ages.ages == (1, 0, 1) and state.ages.generations == (0, 1, 0)


# ---------------------------------------------------------------- who donates

def test_donor_functions_exclude_replaced_and_non_finite():
    m = [5.0, NAN, 3.0, 9.0, INF, 1.0]
    assert donors_all_others(m, [5]) == [0, 2, 3]
    assert donors_best_k(m, [5], 2) == [0, 3]
    assert donors_best_k([1.0, 2.0, 2.0, 2.0], [0], 2) == [1, 2]    # ties prefer lower ranks
    assert donors_all_others([NAN, 1.0], [1]) == []


def test_donors_random_is_seeded_and_valid():
    m = list(range(10))
    a, b = donors_random(m, [0, 1], 4, rng=5), donors_random(m, [0, 1], 4, rng=5)
    assert a == b and len(a) == 4 and not {0, 1} & set(a) and a == sorted(a)
    assert donors_random([1.0, NAN, 2.0], [0], 5, rng=0) == [2]
    with pytest.raises(ConfigError, match="rng"):
        donors_random(m, [0], 2, rng=None)
    with pytest.raises(ConfigError, match="positive"):
        donors_best_k(m, [0], 0)


@FAST
@given(metric_lists, st.data())
def test_donors_never_replaced_or_non_finite(metrics, data):
    n = len(metrics)
    replaced = data.draw(st.lists(st.integers(0, n - 1), max_size=n))
    k = data.draw(st.integers(1, n + 1))
    for ds in (donors_all_others(metrics, replaced), donors_best_k(metrics, replaced, k),
               donors_random(metrics, replaced, k, rng=data.draw(st.integers(0, 99)))):
        assert all(d not in replaced and math.isfinite(metrics[d]) for d in ds)
        assert ds == sorted(set(ds))
    best = donors_best_k(metrics, replaced, k)
    rest = [r for r in donors_all_others(metrics, replaced) if r not in best]
    assert all((metrics[b], -b) > (metrics[r], -r) for b in best for r in rest)


def test_donor_rule():
    with pytest.raises(ConfigError, match="kind"):
        DonorRule("worst")
    with pytest.raises(ConfigError, match="positive"):
        DonorRule("best_k")
    with pytest.warns(UserWarning, match="ignores k"):
        DonorRule("all", k=3)
    assert select_donors([1.0, 2.0, 3.0], [0], DonorRule("best_k", 1)) == [2]


# ---------------------------------------------------------------- with what weight

def test_weighted_mean_favours_better_donors_regression_torchgfn():
    # torchgfn weighted 1 / (metric + 1e-8): the worst donor (metric 1) got the most weight.
    w = averaging_weights([1.0, 2.0, 10.0, 0.0], [0, 1, 2], "weighted_mean")
    assert w[2] > w[1] > w[0] > 0
    neg = averaging_weights([-10.0, -1.0, -0.001], [0, 1, 2], "weighted_mean")   # -loss metrics
    assert neg[2] > neg[1] > neg[0] > 0 and math.isclose(sum(neg), 1.0)


@FAST
@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=10), st.integers(-10**6, 10**6),
       st.floats(0.01, 100.0))
def test_rank_weights_properties(values, shift, scale):
    w = rank_weights(values)
    assert np.all(w > 0) and math.isclose(w.sum(), 1.0)
    for i, vi in enumerate(values):
        for j, vj in enumerate(values):
            if vi > vj:
                assert w[i] > w[j]
            if vi == vj:
                assert w[i] == w[j]
    np.testing.assert_allclose(rank_weights([v + shift for v in values]), w)
    np.testing.assert_allclose(rank_weights([v * scale for v in values]), w)


def test_strategy_weights():
    m = [3.0, 1.0, 3.0, 0.0]
    assert averaging_weights(m, [0, 1, 2], "mean") == pytest.approx((1 / 3,) * 3)
    assert averaging_weights(m, [0, 1, 2], Strategy.BEST_ONLY) == (1.0, 0.0, 0.0)   # tie -> lower rank
    assert averaging_weights(m, [], "reset_weights") == ()
    with pytest.raises(ConfigError, match="no donors"):
        averaging_weights(m, [0], "reset_weights")
    with pytest.raises(ConfigError, match="at least one donor"):
        averaging_weights(m, [], "mean")
    with pytest.raises(ConfigError, match="non-finite"):
        averaging_weights([NAN, 1.0], [0, 1], "mean")
    with pytest.raises(ConfigError, match="distinct"):
        averaging_weights(m, [0, 0], "mean")
    with pytest.raises(ConfigError, match="choose one of"):
        averaging_weights(m, [0], "median")


def test_rank_weights_rejects_bad_input():
    with pytest.raises(ConfigError):
        rank_weights([])
    with pytest.raises(ConfigError):
        rank_weights([1.0, NAN])


def test_combine_arrays_and_dicts_keep_dtype():
    a = {"w": np.full((2, 3), 1.0, np.float32), "b": [np.array([2, 4], np.int64)]}
    b = {"w": np.full((2, 3), 4.0, np.float32), "b": [np.array([3, 8], np.int64)]}
    out = combine([a, b], [0.25, 0.75])
    assert out["w"].dtype == np.float32 and out["b"][0].dtype == np.int64
    np.testing.assert_array_equal(out["w"], np.full((2, 3), 3.25, np.float32))
    np.testing.assert_array_equal(out["b"][0], [3, 7])      # 2.75 -> 3, 7.0 -> 7


def test_combine_accumulates_in_float64():
    x = np.float16(2049.0 / 2048)                          # needs float64 to average exactly
    donors = [np.array([x], np.float16) for _ in range(7)] + [np.array([1.0], np.float16)]
    out = combine(donors, [1 / 8] * 8)
    expected = (7 * np.float64(x) + 1.0) / 8
    assert out.dtype == np.float16 and out[0] == np.float16(expected)


@FAST
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5), st.integers(1, 5))
def test_combine_of_identical_donors_is_identity(values, d):
    arr = np.array(values, np.float32)
    out = combine([arr.copy() for _ in range(d)], [1 / d] * d)
    np.testing.assert_allclose(out, arr, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("donors, weights, match", [
    ([np.zeros(2), np.zeros(3)], [0.5, 0.5], "shape"),
    ([np.zeros(2), np.zeros(2, np.float32)], [0.5, 0.5], "dtype"),
    ([{"a": np.zeros(1)}, {"b": np.zeros(1)}], [0.5, 0.5], "keys"),
    ([[np.zeros(1)], [np.zeros(1), np.zeros(1)]], [0.5, 0.5], "length"),
    ([np.array(["x"])], [1.0], "dtype"),
])
def test_combine_mismatch_errors(donors, weights, match):
    with pytest.raises(ValueError, match=match):
        combine(donors, weights)


@pytest.mark.parametrize("weights", [[0.5], [0.7, 0.7], [-0.5, 1.5], [NAN, 1.0]])
def test_combine_weight_validation(weights):
    with pytest.raises(ConfigError, match="weight"):
        combine([np.zeros(1), np.ones(1)], weights)


def test_apply_momentum():
    old = {"w": np.array([10.0, 0.0], np.float32)}
    new = {"w": np.array([0.0, 10.0], np.float32)}
    np.testing.assert_array_equal(apply_momentum(old, new, 0.0)["w"], new["w"])
    out = apply_momentum(old, new, 0.25)
    np.testing.assert_allclose(out["w"], [2.5, 7.5])
    assert out["w"].dtype == np.float32
    lst = apply_momentum([np.ones(2)], [np.zeros(2)], 0.5)
    np.testing.assert_allclose(lst[0], [0.5, 0.5])
    for bad in (1.0, -0.1, NAN):
        with pytest.raises(ConfigError, match="momentum"):
            apply_momentum(old, new, bad)


def test_optimizer_action():
    assert DEFAULT_OPTIMIZER_POLICY is OptimizerPolicy.RESET
    assert optimizer_action("reset", 0, [1, 2], [0.5, 0.5]) is None
    assert optimizer_action("keep", 0, [1, 2], [0.5, 0.5]) is None
    assert optimizer_action("copy", 0, [1, 2], [0.5, 0.5]) == 1                     # weight tie -> lower
    assert optimizer_action("copy", 0, [1, 2], [0.5, 0.5], metrics=[0, 1, 9]) == 2   # best metric
    assert optimizer_action("copy", 0, [1, 2], [0.25, 0.75]) == 2
    assert optimizer_action("copy", 0, [], []) is None
    with pytest.raises(ConfigError, match="itself"):
        optimizer_action("copy", 1, [1], [1.0])
    with pytest.raises(ConfigError, match="choose one of"):
        optimizer_action("average", 0, [1], [1.0])


# ---------------------------------------------------------------- the decision

def test_decide_basic_and_json_round_trip():
    m = [1.0, 5.0, NAN, 3.0, -2.0, 4.0, 4.0, 0.0]
    d = decide(m, ReplacementRule(ratio=0.25), DonorRule("best_k", 3), "weighted_mean",
               iteration=10, optimizer_policy="copy")
    assert d.replaced == (2, 4)
    assert d.donors == {2: (1, 5, 6), 4: (1, 5, 6)}
    assert d.weights[2] == pytest.approx((0.5, 0.25, 0.25))
    assert d.copy_optimizer_from == {2: 1, 4: 1}
    assert "non-finite" in d.reasons[2] and d.skipped == {}
    assert d.donor_ranks == (1, 5, 6) and d.recipients(5) == (2, 4) and d.recipients(0) == ()
    assert Decision.from_dict(json.loads(json.dumps(d.to_dict()))) == d


def test_decide_best_only_and_reset():
    m = [1.0, 5.0, 3.0, 0.0]
    d = decide(m, ReplacementRule(ratio=0.5), strategy="best_only")
    assert d.replaced == (0, 3) and d.donors == {0: (1,), 3: (1,)} and d.weights[0] == (1.0,)
    r = decide(m, ReplacementRule(ratio=0.5), strategy="reset_weights", optimizer_policy="copy")
    assert r.replaced == (0, 3) and r.donors == {0: (), 3: ()} and r.copy_optimizer_from == {0: None, 3: None}


def test_decide_reports_no_valid_donor():
    d = decide([NAN, NAN, NAN], ReplacementRule(threshold=0.0))
    assert d.replaced == () and sorted(d.skipped) == [1, 2]      # equal metrics: rank 0 survives
    assert d.summary.startswith("no replacement: no valid donor")
    quiet = decide([1.0, 2.0], ReplacementRule(threshold=0.0))
    assert quiet.replaced == () and quiet.summary == "no replacement: no agent selected"


def test_decide_random_donors_deterministic_per_seed():
    m = list(range(20))
    args = (m, ReplacementRule(ratio=0.2), DonorRule("random", 3))
    a, b = decide(*args, rng=42), decide(*args, rng=42)
    assert a == b and len(a.replaced) == 4
    assert any(a.donors[r] != a.donors[a.replaced[0]] for r in a.replaced)   # drawn per replaced rank
    with pytest.raises(ConfigError, match="rng"):
        decide(*args)


def test_decide_threshold_cooldown_over_iterations():
    rule = ReplacementRule(threshold=0.5, cooldown=3)
    state = init_state(3, rule)
    history = []
    for it in range(6):
        d = decide([0.1, 0.9, 0.8], rule, iteration=it, state=state)
        history.append(d.replaced)
        state = update_state(state, d.replaced, it)
    assert history == [(0,), (), (), (0,), (), ()]


def test_decide_age_rule_over_iterations():
    rule = ReplacementRule(age_range=(2, 2))
    state = init_state(2, rule, rng=0)
    seen = []
    for it in range(5):
        d = decide([1.0, 2.0], rule, iteration=it, state=state)
        seen.append(d.replaced)
        state = update_state(state, d.replaced, it)
    # at iteration 2 both are due but the best agent always survives; rank 1 goes one step later
    assert seen == [(), (), (0,), (1,), ()]


@FAST
@given(metric_lists, st.floats(0.05, 0.95), st.sampled_from(list(Strategy)),
       st.sampled_from(["all", "best_k", "random"]), st.integers(0, 1000))
def test_decide_invariants(metrics, ratio, strategy, kind, seed):
    donor_rule = DonorRule(kind, None if kind == "all" else 2)
    d = decide(metrics, ReplacementRule(ratio=ratio), donor_rule, strategy, rng=seed)
    assert d == decide(metrics, ReplacementRule(ratio=ratio), donor_rule, strategy, rng=seed)
    assert len(d.replaced) < len(metrics)
    for r in d.replaced:
        assert all(x not in d.replaced and math.isfinite(metrics[x]) for x in d.donors[r])
        if strategy is not Strategy.RESET:
            assert d.donors[r] and math.isclose(sum(d.weights[r]), 1.0)
    assert Decision.from_dict(json.loads(json.dumps(d.to_dict()))) == d


@pytest.mark.parametrize("change, match", [
    (dict(donors={}), "one entry per replaced"),
    (dict(donors={1: (1,)}), "must not be replaced"),
    (dict(weights={1: (0.7,)}), "sum to 1"),
    (dict(copy_optimizer_from={1: 3}), "not one of its donors"),
    (dict(skipped={1: "x"}), "both replaced and skipped"),
    (dict(strategy="median"), "choose one of"),
])
def test_decision_validates(change, match):
    base = dict(replaced=(1,), donors={1: (0,)}, weights={1: (1.0,)}, copy_optimizer_from={1: None},
                strategy="mean")
    with pytest.raises(ConfigError, match=match):
        Decision(**{**base, **change})


def test_decision_from_dict_errors():
    with pytest.raises(ConfigError, match="format"):
        Decision.from_dict({"replaced": []})
    with pytest.raises(ConfigError, match="lacks the field 'donors'"):
        Decision.from_dict({"format": 1, "replaced": []})
    with pytest.raises(ConfigError, match="ranks"):
        Decision(replaced=(), donors={"a": ()}, weights={}, copy_optimizer_from={}, strategy="mean")


# ---------------------------------------------------------------- exploring hyper-parameters

def test_explore_perturbs_numbers_and_keeps_others():
    hp = {"lr": 0.01, "batch": 32, "act": "relu", "flag": True}
    out = explore(hp, rng=0)
    assert hp == {"lr": 0.01, "batch": 32, "act": "relu", "flag": True}
    assert out["act"] == "relu" and out["flag"] is True
    assert out["lr"] in (pytest.approx(0.008), pytest.approx(0.012))
    assert isinstance(out["batch"], int) and out["batch"] in (26, 38)
    assert explore(hp, rng=0) == out


def test_explore_small_ints_still_move():
    outs = {explore({"n": 1}, rng=s)["n"] for s in range(20)}
    assert outs == {0, 2}


def test_explore_choices_and_samplers():
    space = {"opt": ["sgd", "adam", "rmsprop"], "lr": lambda g: 0.5}
    never = [explore({"opt": "adam", "lr": 1.0}, s, resample_prob=0.0, space=space) for s in range(20)]
    assert {o["opt"] for o in never} == {"sgd", "rmsprop"} and all(o["lr"] != 0.5 for o in never)
    always = explore({"opt": "adam", "lr": 1.0}, 1, resample_prob=1.0, space=space)
    assert always["lr"] == 0.5 and always["opt"] in space["opt"]
    assert explore({"opt": "sgd"}, 3, resample_prob=0.0, space={"opt": ["sgd"]})["opt"] == "sgd"
    assert explore({"opt": "lamb"}, 3, resample_prob=0.0, space={"opt": space["opt"]})["opt"] in space["opt"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(perturb=()), "perturb"),
    (dict(perturb=(0.0, 1.2)), "perturb"),
    (dict(resample_prob=1.5), "resample_prob"),
    (dict(space={"momentum": [0.9]}), "lacks"),
    (dict(space={"lr": []}), "non-empty"),
    (dict(space={"lr": "abc"}), "non-empty"),
])
def test_explore_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        explore({"lr": 0.1}, 0, **kwargs)


def test_a_group_decision_summary_names_agents_by_global_rank():
    """A group's decision works on positions; its summary for logs names the members' global ranks."""
    decision = decide([5.0, 1.0, 9.0], ReplacementRule(ratio=0.34), DonorRule(kind="best_k", k=1))
    assert decision.replaced == (1,) and decision.summary == "replace 1 of 3 agents [1] by mean"
    assert decision.summary_in([0, 2, 3]) == "replace 1 of 3 agents [2] by mean"
    assert decision.summary_in(range(3)) == decision.summary
    own = dataclasses.replace(decision, summary="replace the laggard")  # a caller's own text: kept as it is
    assert own.summary_in([0, 2, 3]) == "replace the laggard"
