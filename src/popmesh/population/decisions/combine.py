"""With what weight: averaging strategies, weighted combination of donor weights, momentum, optimizer policy.

All pure functions over numpy arrays or nested lists / tuples / dicts of them. Combination
accumulates in float64 (complex128 for complex inputs) and casts back to each input's dtype, so a
float16 or float32 model is not rounded once per donor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.selection import _is_real, as_metrics

__all__ = [
    "Strategy",
    "rank_weights",
    "averaging_weights",
    "combine",
    "apply_momentum",
    "OptimizerPolicy",
    "DEFAULT_OPTIMIZER_POLICY",
    "optimizer_action",
]

_WEIGHT_SUM_TOL = 1e-6


class Strategy(StrEnum):
    """How a replaced agent's new weights are formed from its donors'."""

    MEAN = "mean"                     # equal weights over the donors
    WEIGHTED_MEAN = "weighted_mean"   # rank-based weights, better donors weigh more (see rank_weights)
    BEST_ONLY = "best_only"           # a copy of the best donor
    RESET = "reset_weights"           # no donors: re-initialise from the model builder

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        """The member named by ``value``; ConfigError listing the choices otherwise."""
        return _parse_member(cls, value, "averaging strategy")


class OptimizerPolicy(StrEnum):
    """What happens to a replaced agent's optimizer state (Adam moments, step counts)."""

    RESET = "reset"   # rebuild the optimizer from the builder: the safe default
    KEEP = "keep"     # keep the agent's own state, although it was built for its old weights
    COPY = "copy"     # copy the best donor's optimizer state

    @classmethod
    def parse(cls, value: str | OptimizerPolicy) -> OptimizerPolicy:
        """The member named by ``value``; ConfigError listing the choices otherwise."""
        return _parse_member(cls, value, "optimizer policy")


def _parse_member(cls: Any, value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {[m.value for m in cls]}") from None


DEFAULT_OPTIMIZER_POLICY = OptimizerPolicy.RESET
"""``reset``: Adam moments estimated for the old weights do not fit the new averaged weights."""


def rank_weights(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Weights proportional to each value's rank (1 = lowest; equal values share their mean rank).

    The weights are positive, sum to 1, grow strictly with the value, and depend only on the
    order of the values, so they work for negative metrics (``-loss``) and do not change when a
    constant is added to every value or every value is scaled by a positive factor. With ``d``
    distinct values the best gets ``d`` times the weight of the worst.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)):
        raise ConfigError(f"rank_weights needs a non-empty flat sequence of finite values, got {values!r}")
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    ranks = (starts + (counts + 1) / 2.0)[inverse.reshape(-1)]
    return ranks / ranks.sum()


def averaging_weights(metrics: Sequence[float] | np.ndarray, donors: Sequence[int],
                      strategy: str | Strategy) -> tuple[float, ...]:
    """One weight per donor (same order as ``donors``) for ``strategy``.

    ``mean``: equal; ``weighted_mean``: :func:`rank_weights` of the donors' metrics; ``best_only``:
    1 on the best donor (ties: the lowest rank), 0 elsewhere; ``reset_weights``: no donors, ``()``.
    Donors must have finite metrics. Higher metric is better.
    """
    strategy = Strategy.parse(strategy)
    m = as_metrics(metrics)
    donors = list(map(int, donors))
    if strategy is Strategy.RESET:
        if donors:
            raise ConfigError("reset_weights re-initialises the agent and takes no donors; pass donors=()")
        return ()
    if not donors:
        raise ConfigError(f"strategy {strategy.value!r} needs at least one donor; with no valid donor "
                          "there is nothing to average (decide() reports this as no replacement)")
    if len(set(donors)) != len(donors) or min(donors) < 0 or max(donors) >= m.size:
        raise ConfigError(f"donors {donors} must be distinct ranks in 0..{m.size - 1}")
    index = np.fromiter(donors, dtype=np.intp, count=len(donors))
    if not np.all(np.isfinite(m[index])):
        raise ConfigError(f"donors {donors} include non-finite metrics {m[index].tolist()}; they may not donate")
    return _weights_of(m, index, strategy)


def _weights_of(m: np.ndarray, index: np.ndarray, strategy: Strategy) -> tuple[float, ...]:
    """:func:`averaging_weights` of checked donors ``index`` (distinct ranks with finite metrics,
    at least one) for a strategy other than ``reset_weights``; vectorised, for decide() at scale."""
    count = int(index.size)
    if strategy is Strategy.MEAN:
        return (1.0 / count,) * count
    dm = m[index]
    if strategy is Strategy.WEIGHTED_MEAN:
        return tuple(rank_weights(dm).tolist())
    tied = np.flatnonzero(dm == dm.max())
    best = int(tied[np.argmin(index[tied])])  # ties: the lowest rank
    out = [0.0] * count
    out[best] = 1.0
    return tuple(out)


def check_weights(weights: Sequence[float], count: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size != count or count == 0:
        raise ConfigError(f"need one weight per donor: got {w.size} weights for {count} donors")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or abs(w.sum() - 1.0) > _WEIGHT_SUM_TOL:
        raise ConfigError(f"weights must be finite, non-negative and sum to 1, got {w.tolist()}; "
                          "normalise them first (e.g. averaging_weights())")
    return w


def _leaf_dtype(leaves: Sequence[np.ndarray], path: str) -> np.dtype:
    first = leaves[0]
    for i, leaf in enumerate(leaves[1:], start=1):
        if leaf.shape != first.shape or leaf.dtype != first.dtype:
            raise ValueError(f"{path or 'array'}: input {i} has shape {leaf.shape} dtype {leaf.dtype}, "
                             f"input 0 has shape {first.shape} dtype {first.dtype}; all inputs must match")
    if first.dtype.kind not in "biufc":
        raise ValueError(f"{path or 'array'}: cannot average arrays of dtype {first.dtype}")
    return first.dtype


def _cast_back(acc: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind in "biu":
        acc = np.rint(acc)
    return acc.astype(dtype)


def _weighted_sum(leaves: Sequence[np.ndarray], w: np.ndarray, path: str) -> np.ndarray:
    dtype = _leaf_dtype(leaves, path)
    acc_type = np.result_type(dtype, np.float64)
    acc = np.zeros(leaves[0].shape, dtype=acc_type)
    for wi, leaf in zip(w, leaves):
        acc += wi * leaf.astype(acc_type)
    return _cast_back(acc, dtype)


def _tree_map(fn: Callable[[list[np.ndarray], str], np.ndarray], trees: Sequence[Any], path: str = "") -> Any:
    """Apply ``fn(leaves, path)`` leaf-wise over same-structured trees of dicts, lists and tuples."""
    first = trees[0]
    if isinstance(first, Mapping):
        for i, t in enumerate(trees):
            if not isinstance(t, Mapping) or set(t) != set(first):
                got = sorted(map(str, t)) if isinstance(t, Mapping) else type(t).__name__
                raise ValueError(f"{path or 'tree'}: input {i} has keys {got}, "
                                 f"input 0 has {sorted(map(str, first))}")
        return {k: _tree_map(fn, [t[k] for t in trees], f"{path}.{k}" if path else str(k)) for k in first}
    if isinstance(first, (list, tuple)):
        for i, t in enumerate(trees):
            if type(t) is not type(first) or len(t) != len(first):
                raise ValueError(f"{path or 'tree'}: input {i} is a {type(t).__name__} of length "
                                 f"{len(t) if isinstance(t, (list, tuple)) else '-'}, input 0 a "
                                 f"{type(first).__name__} of length {len(first)}")
        out = [_tree_map(fn, [t[j] for t in trees], f"{path}[{j}]") for j in range(len(first))]
        return type(first)(*out) if hasattr(first, "_fields") else type(first)(out)
    return fn([np.asarray(t) for t in trees], path)


def combine(donor_arrays: Sequence[Any], weights: Sequence[float]) -> Any:
    """``Σ weights[i] · donor_arrays[i]``, leaf by leaf, with the structure and dtypes of the inputs.

    ``donor_arrays`` is a list with one entry per donor: an array, or a dict / list / tuple of
    arrays (e.g. a state dict as numpy). All entries must have the same structure, shapes and
    dtypes (ValueError naming the first difference otherwise). Accumulates in float64, then casts
    back; integer and bool leaves are rounded to the nearest value (half to even).
    """
    w = check_weights(weights, len(donor_arrays))
    return _tree_map(lambda leaves, path: _weighted_sum(leaves, w, path), list(donor_arrays))


def _check_momentum(m: float) -> float:
    if not _is_real(m) or not 0.0 <= m < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {m!r}; 0 takes the combined weights as they are")
    return float(m)


def apply_momentum(old: Any, combined: Any, m: float) -> Any:
    """``m·old + (1 − m)·combined`` leaf by leaf, for arrays or dicts / lists / tuples of arrays.

    ``m = 0`` returns ``combined``; larger ``m`` keeps more of the replaced agent's own weights.
    Both trees must share structure, shapes and dtypes; the result has the dtypes of ``old``.
    """
    mm = _check_momentum(m)
    w = np.array([mm, 1.0 - mm])
    return _tree_map(lambda leaves, path: _weighted_sum(leaves, w, path), [old, combined])


def optimizer_action(policy: str | OptimizerPolicy, replaced: int, donors: Sequence[int],
                     weights: Sequence[float],
                     metrics: Sequence[float] | np.ndarray | None = None) -> int | None:
    """The donor rank whose optimizer state ``replaced`` should copy, or None.

    None means: rebuild the optimizer (``reset``), keep the agent's own (``keep``), or, for ``copy``
    with no donors (``reset_weights``), fall back to a rebuild. For ``copy`` the best donor is the
    one with the highest metric when ``metrics`` is given, else the one with the largest weight;
    ties go to the lowest rank.
    """
    policy = OptimizerPolicy.parse(policy)
    donors = list(map(int, donors))
    if len(weights) != len(donors):
        raise ConfigError(f"{len(weights)} weights for {len(donors)} donors of rank {replaced}")
    if replaced in donors:
        raise ConfigError(f"rank {replaced} cannot donate to itself")
    if policy is not OptimizerPolicy.COPY or not donors:
        return None
    if metrics is not None:
        m = as_metrics(metrics)
        scores = [m[d] if math.isfinite(m[d]) else -math.inf for d in donors]
    else:
        scores = [float(w) for w in weights]
    best = max(range(len(donors)), key=lambda i: (scores[i], -donors[i]))
    return donors[best]
