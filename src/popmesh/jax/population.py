"""In-graph population replacement: the worst members take a combination of the others' weights.

The decision (:func:`replacement_plan`) is a pure function of every member's metric; the mechanism
(:func:`replace_worst`) moves weights with one weighted ``psum`` over the population axis inside
``shard_map``, so the whole step is jit-compiled and never leaves the devices. It is the torchgfn
``spawn_policy`` idea (worst-k by ratio, combined donors, momentum) with its bugs fixed, and decides
exactly like the numpy core in :mod:`popmesh.population` (``worst_by_ratio``, ``donors_all_others``,
``averaging_weights``): same tie rule, same rank-based ``weighted_mean``, same validity of donors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh

import jax
from popmesh.core.errors import ConfigError
from popmesh.jax.axes import POPULATION_AXIS, AxisName, all_gather, psum

__all__ = [
    "Strategy",
    "ReplacementPlan",
    "num_replaced",
    "replacement_plan",
    "replace_worst",
    "population_update",
]

Strategy = Literal["mean", "weighted_mean", "best_only"]
_STRATEGIES = ("mean", "weighted_mean", "best_only")


_RATIO_SLACK = 1e-9  # floor(100 * 0.29) is 29, as in popmesh.population.decisions.selection


class ReplacementPlan(NamedTuple):
    """Who is replaced (``replaced[i]``) and the donor weights every replaced member receives.

    ``replaced`` is all False when no member may donate (every other metric non-finite).
    """

    replaced: jax.Array  # bool [n]
    weights: jax.Array  # float32 [n], zero for replaced members, sums to 1


def _check(replacement_ratio: float, strategy: str, momentum: float) -> None:
    if not 0.0 < replacement_ratio < 1.0:
        raise ConfigError(
            f"replacement_ratio must be in the open interval (0, 1), got {replacement_ratio}; "
            "e.g. 0.25 replaces the worst quarter"
        )
    if strategy not in _STRATEGIES:
        raise ConfigError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(
            f"momentum must be in [0, 1) (the share of its own weights a member keeps), got {momentum}"
        )


def num_replaced(n: int, replacement_ratio: float) -> int:
    """``max(1, floor(n * ratio))`` capped at ``n - 1`` so one member survives; 0 when ``n <= 1``."""
    if n <= 1:
        return 0
    return min(max(1, math.floor(n * replacement_ratio + _RATIO_SLACK)), n - 1)


def _rank_weights(metrics: jax.Array, donors: jax.Array) -> jax.Array:
    """Weights proportional to each donor's rank among donors (1 = lowest; ties share the mean rank)."""
    pair = donors[None, :]
    lower = jnp.sum(pair & (metrics[None, :] < metrics[:, None]), axis=1)
    equal = jnp.sum(pair & (metrics[None, :] == metrics[:, None]), axis=1)
    ranks = jnp.where(donors, lower + (equal + 1) / 2.0, 0.0)
    return ranks / jnp.sum(ranks)


def _donor_weights(metrics: jax.Array, donors: jax.Array, strategy: str) -> jax.Array:
    if strategy == "mean":
        return donors / jnp.sum(donors)
    if strategy == "weighted_mean":
        return _rank_weights(metrics, donors)
    best = jnp.argmax(jnp.where(donors, metrics, -jnp.inf))  # first index among equal maxima
    return jax.nn.one_hot(best, metrics.shape[0], dtype=jnp.float32)


def replacement_plan(
    metrics: jax.Array, replacement_ratio: float = 0.2, strategy: Strategy = "mean"
) -> ReplacementPlan:
    """Pick the worst members and the weights of the donors that replace them (higher metric = better).

    The ``num_replaced(n, replacement_ratio)`` worst members are replaced: non-finite metrics (NaN,
    ±inf: a diverged member) count as worst, and among equal metrics the *higher* index goes first.
    Donors are the other members with finite metrics. Weights: ``mean`` uniform over donors;
    ``weighted_mean`` proportional to each donor's rank among donors (better donors weigh more; works
    for negative metrics such as ``-loss``; invariant to shifting or scaling the metrics);
    ``best_only`` one-hot on the best donor (lowest index on ties).
    """
    _check(replacement_ratio, strategy, 0.0)
    metrics = jnp.asarray(metrics, jnp.float32)
    n = metrics.shape[0]
    finite = jnp.isfinite(metrics)
    key = jnp.where(finite, metrics, -jnp.inf)
    order = jnp.lexsort((-jnp.arange(n), key))  # worst first; ties: higher index first
    replaced = jnp.zeros(n, bool).at[order[: num_replaced(n, replacement_ratio)]].set(True)
    donors = ~replaced & finite
    replaced = replaced & jnp.any(donors)  # nobody may donate: nobody is replaced
    weights = jnp.where(jnp.any(donors), _donor_weights(metrics, donors, strategy), 0.0)
    return ReplacementPlan(replaced, weights.astype(jnp.float32))


def _mix(leaf: jax.Array, local_weights: jax.Array, replaced: jax.Array, axis: AxisName | None,
         momentum: float) -> jax.Array:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf  # integer leaves (e.g. optimiser step counts) are kept
    combined = psum(jnp.tensordot(local_weights.astype(leaf.dtype), leaf, axes=1), axis)
    mixed = momentum * leaf + (1.0 - momentum) * combined[None]
    mask = replaced.reshape(replaced.shape + (1,) * (leaf.ndim - 1))
    return jnp.where(mask, mixed.astype(leaf.dtype), leaf)


def replace_worst(
    members: Any,
    metrics: jax.Array,
    axis_name: AxisName | None = POPULATION_AXIS,
    *,
    replacement_ratio: float = 0.2,
    strategy: Strategy = "mean",
    momentum: float = 0.0,
) -> tuple[Any, jax.Array]:
    """Replace the worst members' weights by a combination of the other members' (in-graph).

    ``members``: pytree whose leaves hold this device's members stacked on axis 0 (``L`` per device,
    ``L * axis_size`` in all, member ``i`` of device ``d`` is global member ``d * L + i``);
    ``metrics``: this device's ``[L]`` metrics. Every device of ``axis_name`` must call this (inside
    ``shard_map``); ``None`` means all members are local. A replaced member becomes
    ``momentum * own + (1 - momentum) * combined``; floating leaves only (integer leaves are kept, so
    pass ``(params, opt_state)`` to average optimiser moments too). Returns ``(new_members,
    replaced)`` with ``replaced`` the ``[L]`` mask of this device's replaced members.
    """
    _check(replacement_ratio, strategy, momentum)
    local = metrics.shape[0]
    shapes = {tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(members)}
    bad = sorted(shape for shape in shapes if shape[:1] != (local,))
    if jnp.ndim(metrics) != 1 or bad:
        raise ConfigError(
            f"replace_worst: metrics must be [L] and every member leaf [L, ...] with L = members on this "
            f"device; got metrics {tuple(jnp.shape(metrics))} and leaves {bad}"
        )
    plan = replacement_plan(all_gather(metrics, axis_name, tiled=True), replacement_ratio, strategy)
    start = (jax.lax.axis_index(axis_name) if axis_name is not None else 0) * local
    local_weights = jax.lax.dynamic_slice_in_dim(plan.weights, start, local)
    replaced = jax.lax.dynamic_slice_in_dim(plan.replaced, start, local)
    mix = lambda leaf: _mix(leaf, local_weights, replaced, axis_name, momentum)  # noqa: E731
    return jax.tree.map(mix, members), replaced


def population_update(
    mesh: Mesh,
    member_specs: Any,
    axis_name: str = POPULATION_AXIS,
    *,
    replacement_ratio: float = 0.2,
    strategy: Strategy = "mean",
    momentum: float = 0.0,
) -> Callable[[Any, jax.Array], tuple[Any, jax.Array]]:
    """A jit-compiled ``f(members, metrics) -> (members, replaced)`` over the population axis of ``mesh``.

    ``members`` are global arrays with the population on axis 0, sharded by ``member_specs`` (a
    ``PartitionSpec`` or pytree prefix of them whose first entry is ``axis_name``); ``metrics`` is the
    ``[population]`` vector sharded the same way. Wraps :func:`replace_worst` in ``jax.shard_map``.
    """
    _check(replacement_ratio, strategy, momentum)
    metric_spec = jax.sharding.PartitionSpec(axis_name)  # type: ignore[no-untyped-call]  # jax: PartitionSpec is unannotated

    def body(members: Any, metrics: jax.Array) -> tuple[Any, jax.Array]:
        return replace_worst(members, metrics, axis_name, replacement_ratio=replacement_ratio,
                             strategy=strategy, momentum=momentum)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(member_specs, metric_spec),
                           out_specs=(member_specs, metric_spec))
    return jax.jit(mapped)
