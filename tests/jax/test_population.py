"""In-graph population replacement against a numpy reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj
from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import averaging_weights
from popmesh.population.decisions.selection import donors_all_others, worst_by_ratio

STRATEGIES = ["mean", "weighted_mean", "best_only"]
_jit_plan = jax.jit(pj.replacement_plan, static_argnums=(1, 2))


def np_plan(metrics, ratio, strategy):
    """Reference decision: popmesh's numpy population core (the torch/MPI policies decide with it)."""
    n = len(metrics)
    replaced_ranks = worst_by_ratio(metrics, ratio) if n > 1 else []
    donors = donors_all_others(metrics, replaced_ranks)
    replaced, weights = np.zeros(n, bool), np.zeros(n)
    if donors:
        replaced[replaced_ranks] = True
        weights[donors] = averaging_weights(metrics, donors, strategy)
    return replaced, weights


def np_replace(members, metrics, ratio, strategy, momentum):
    replaced, weights = np_plan(metrics, ratio, strategy)
    out = {}
    for name, leaf in members.items():
        leaf = np.asarray(leaf, np.float64)
        combined = np.tensordot(weights, leaf, axes=1)
        out[name] = np.where(replaced.reshape((-1,) + (1,) * (leaf.ndim - 1)),
                             momentum * leaf + (1 - momentum) * combined, leaf)
    return out, replaced


def _members(n):
    w = jnp.arange(n * 6, dtype=jnp.float32).reshape(n, 2, 3) / 7
    return {"w": w, "b": jnp.arange(n, dtype=jnp.float32) ** 2}


@pytest.mark.parametrize(
    ("n", "ratio", "k"),
    [(1, 0.5, 0), (2, 0.1, 1), (8, 0.2, 1), (8, 0.25, 2), (8, 0.99, 7), (5, 0.5, 2), (100, 0.29, 29)],
)
def test_num_replaced_keeps_at_least_one_member(n, ratio, k):
    assert pj.num_replaced(n, ratio) == k


def test_closed_form_metrics_rank_plus_one():
    metrics = np.arange(1.0, 9.0)  # member r scores r + 1; ratio 0.25 replaces members 0 and 1
    mean = _jit_plan(metrics, 0.25, "mean")
    assert np.array_equal(mean.replaced, [True, True] + [False] * 6)
    assert np.allclose(mean.weights, [0, 0] + [1 / 6] * 6)
    weighted = _jit_plan(metrics, 0.25, "weighted_mean")
    assert np.allclose(weighted.weights, np.r_[0, 0, np.arange(1.0, 7.0) / 21])  # donor rank / sum of ranks
    ties = _jit_plan(np.array([2.0, 1.0, 1.0, 5.0, 5.0]), 0.4, "weighted_mean")
    assert np.array_equal(ties.replaced, [False, True, True, False, False])  # higher index first on ties
    assert np.allclose(ties.weights, [1 / 6, 0, 0, 2.5 / 6, 2.5 / 6])  # equal metrics share the mean rank
    assert np.allclose(_jit_plan(metrics, 0.25, "best_only").weights, np.eye(8)[7])


@settings(max_examples=40, deadline=None)
@given(
    metrics=st.lists(
        st.one_of(st.floats(-5, 5, width=32, allow_subnormal=False),
                  st.sampled_from([0.0, 1.0, np.nan, np.inf, -np.inf])),
        min_size=1, max_size=9,
    ),
    ratio=st.sampled_from([0.1, 0.2, 0.25, 0.5, 0.7, 0.99]),
    strategy=st.sampled_from(STRATEGIES),
)
def test_plan_matches_the_numpy_population_core(metrics, ratio, strategy):
    # Subnormal metrics are excluded: XLA on CPU flushes them to zero, so 1e-45 ties with 0.0 there.
    # That difference is documented in docs/jax.md.
    plan = _jit_plan(np.asarray(metrics, np.float32), ratio, strategy)
    replaced, weights = np_plan(np.asarray(metrics, np.float32), ratio, strategy)
    assert np.array_equal(plan.replaced, replaced)
    assert np.allclose(plan.weights, weights, atol=1e-6)
    assert not np.any(np.asarray(plan.weights)[replaced])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_population_update_on_eight_devices_two_members_each(devices, strategy):
    mesh = Mesh(np.asarray(devices), ("POP",))
    members = _members(16)
    metrics = jnp.asarray(np.random.default_rng(0).normal(size=16), jnp.float32)
    update = pj.population_update(mesh, P("POP"), replacement_ratio=0.3, strategy=strategy, momentum=0.25)
    new, replaced = update(members, metrics)
    want, want_replaced = np_replace(members, metrics, 0.3, strategy, 0.25)
    assert np.array_equal(replaced, want_replaced) and want_replaced.sum() == 4
    for name in members:
        assert np.allclose(new[name], want[name], rtol=1e-5, atol=1e-5)
    assert new["w"].sharding.spec == P("POP")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replace_worst_inside_a_pop_by_dp_shard_map(grid_mesh, strategy):
    members = _members(4)  # one member per POP row, replicated over DP
    metrics = jnp.asarray([0.5, -2.0, 3.0, 1.0])

    def body(members, metrics):
        return pj.replace_worst(members, metrics, "POP", replacement_ratio=0.5, strategy=strategy)

    specs = (P("POP"), P("POP"))
    fn = jax.jit(jax.shard_map(body, mesh=grid_mesh, in_specs=specs, out_specs=specs))
    new, replaced = fn(members, metrics)
    want, want_replaced = np_replace(members, metrics, 0.5, strategy, 0.0)
    assert np.array_equal(replaced, want_replaced)
    for name in members:
        assert np.allclose(new[name], want[name], rtol=1e-6)


def test_single_device_members_and_integer_leaves():
    members = {**_members(5), "count": jnp.arange(5)}
    metrics = jnp.asarray([3.0, 1.0, 2.0, 5.0, 4.0])
    new, replaced = jax.jit(lambda m, x: pj.replace_worst(m, x, None, replacement_ratio=0.4, strategy="mean",
                                                          momentum=0.5))(members, metrics)
    want, want_replaced = np_replace({k: members[k] for k in ("w", "b")}, metrics, 0.4, "mean", 0.5)
    assert np.array_equal(replaced, want_replaced) and list(np.flatnonzero(replaced)) == [1, 2]
    assert np.allclose(new["w"], want["w"], rtol=1e-6) and np.allclose(new["b"], want["b"], rtol=1e-6)
    assert np.array_equal(new["count"], members["count"])


def test_nobody_is_replaced_when_nobody_may_donate():
    members = _members(3)
    metrics = jnp.asarray([np.nan, np.inf, -np.inf])
    new, replaced = pj.replace_worst(members, metrics, None, replacement_ratio=0.5)
    assert not replaced.any() and np.array_equal(new["w"], members["w"])


def test_member_leaves_must_match_the_metrics():
    with pytest.raises(ConfigError, match=r"leaves \[\(3,\)\]"):
        pj.replace_worst({"ok": jnp.zeros((2, 4)), "bad": jnp.zeros(3)}, jnp.zeros(2), None)


@pytest.mark.parametrize(
    "kwargs",
    [{"replacement_ratio": 0.0}, {"replacement_ratio": 1.0}, {"strategy": "median"}, {"momentum": 1.0}],
    ids=["ratio-0", "ratio-1", "strategy", "momentum-1"],
)
def test_bad_settings_are_rejected_before_tracing(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs)).split("_")[0]):
        pj.replace_worst(_members(2), jnp.zeros(2), None, **kwargs)
