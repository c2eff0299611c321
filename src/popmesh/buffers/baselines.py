"""Reward baselines of the replay-buffer service: pure functions over plain values.

A manager tracks the *baseline log-reward* its trainers use to filter what they send (items below
it would not enter the buffer anyway). Strategies, as in torchgfn:

* ``min``: the smallest finite log-reward in the local buffer, once the buffer is full;
* ``percentile``: the ``percentile`` quantile of those log-rewards, once the buffer is full;
* ``ema``: an exponential moving average of each incoming batch's smallest finite log-reward.

Before the buffer is full (or when the manager does not store locally) ``min`` and ``percentile``
fall back to the EMA; with no data yet there is no baseline (None: send everything). A global
baseline synced by the coordinator overrides every local estimate from then on.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from popmesh.core.errors import ConfigError

__all__ = ["BASELINE_STRATEGIES", "Strategy", "check_strategy", "batch_min", "update_ema", "local_baseline",
           "choose_baseline", "reduce_baselines", "keep_mask"]

Strategy = Literal["min", "percentile", "ema"]
BASELINE_STRATEGIES: tuple[str, ...] = ("min", "percentile", "ema")


def check_strategy(strategy: str, percentile: float, alpha: float) -> None:
    """ConfigError unless the strategy and its parameters are valid."""
    if strategy not in BASELINE_STRATEGIES:
        raise ConfigError(f"baseline_strategy={strategy!r}: use one of {', '.join(BASELINE_STRATEGIES)}")
    if not 0.0 <= percentile <= 1.0:
        raise ConfigError(f"baseline_percentile={percentile} must be in [0, 1] (0.5 is the median)")
    if not 0.0 < alpha <= 1.0:
        raise ConfigError(f"baseline_ema_alpha={alpha} must be in (0, 1]")


def _finite(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    return arr[np.isfinite(arr)]


def batch_min(log_rewards: Any) -> float | None:
    """Smallest finite log-reward of a batch; None if it has none (e.g. all -inf)."""
    finite = _finite(log_rewards)
    return float(finite.min()) if finite.size else None


def update_ema(ema: float | None, log_rewards: Any, alpha: float) -> float | None:
    """EMA of batch minima: ``alpha * batch_min + (1 - alpha) * ema``; unchanged by batches without finite values."""
    low = batch_min(log_rewards)
    if low is None:
        return ema
    return low if ema is None else alpha * low + (1.0 - alpha) * ema


def local_baseline(strategy: str, stored_log_rewards: Any, buffer_full: bool, ema: float | None,
                   percentile: float = 0.1) -> float | None:
    """The manager's own baseline: buffer statistic once full (min/percentile), else the EMA."""
    if strategy in ("min", "percentile") and buffer_full and stored_log_rewards is not None:
        finite = _finite(stored_log_rewards)
        if finite.size:
            return float(finite.min() if strategy == "min" else np.quantile(finite, percentile))
    return ema


def choose_baseline(synced: float | None, local: float | None) -> float | None:
    """A synced global baseline wins over the local one."""
    return synced if synced is not None else local


def reduce_baselines(values: list[float | None], how: str = "min") -> float | None:
    """Combine managers' baselines into a global one (``min``, ``mean`` or ``max`` of the known, finite ones)."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    if how not in ("min", "mean", "max"):
        raise ConfigError(f"baseline reduction {how!r}: use 'min', 'mean' or 'max'")
    if not known:
        return None
    return min(known) if how == "min" else max(known) if how == "max" else math.fsum(known) / len(known)


def keep_mask(log_rewards: Any, baseline: float | None) -> np.ndarray:
    """Rows worth sending: ``log_reward >= baseline`` (all rows when there is no baseline yet)."""
    rewards = np.asarray(log_rewards, dtype=np.float64).reshape(-1)
    if baseline is None or not math.isfinite(baseline):
        return np.ones(rewards.shape, dtype=bool)
    return rewards >= baseline
