"""Who is replaced and who donates: pure selection rules for population policies.

Higher metric is better. Non-finite metrics (NaN, -inf **and +inf**) count as the worst possible value:
they are replaced first and never donate. +inf is treated as invalid rather than as the best score
because in practice it comes from a diverged loss or a division by zero, not from an excellent agent.

One total order decides every tie: an agent is *worse* than another when its metric is lower or,
for equal metrics (all non-finite metrics are equal), when its rank index is **higher**. So among
equal metrics the higher rank is replaced first and the lower rank is preferred as a donor, and no
decision depends on numpy's unstable sort.

Everything here is a pure function of plain values; explicit state (:class:`AgeState`,
:class:`SelectionState`) is passed in and returned, never hidden.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from popmesh.core.errors import ConfigError

__all__ = [
    "RngLike",
    "as_metrics",
    "as_generator",
    "order_worst_first",
    "worst_by_ratio",
    "below_threshold",
    "AgeState",
    "init_ages",
    "due_by_age",
    "step_ages",
    "ReplacementRule",
    "SelectionState",
    "init_state",
    "update_state",
    "state_to_json",
    "state_from_json",
    "combine_rules",
    "DonorRule",
    "donors_all_others",
    "donors_best_k",
    "donors_random",
    "draw_donor_rows",
    "select_donors",
    "valid_donors",
    "donors_from_pool",
    "draw_donors",
]

RngLike = int | np.random.Generator
"""A seed (non-negative int) or a numpy Generator; a seed gives the same draws on every rank."""

_RATIO_SLACK = 1e-9  # so that floor(100 * 0.29) is 29, not 28


def as_metrics(metrics: Sequence[float] | np.ndarray) -> np.ndarray:
    """Return ``metrics`` as a new 1-D float64 array (index = agent rank).

    Raises ConfigError when it is empty or not one-dimensional.
    """
    m = np.array(metrics, dtype=np.float64, copy=True)
    if m.ndim != 1:
        raise ConfigError(f"metrics must be a flat sequence with one value per agent, got shape {m.shape}")
    if m.size == 0:
        raise ConfigError("metrics is empty: pass one metric per agent of the population")
    return m


def _sort_key(m: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(m), m, -np.inf)


def order_worst_first(metrics: Sequence[float] | np.ndarray) -> list[int]:
    """All ranks from worst to best (non-finite first; equal metrics: higher rank first)."""
    return _worst_first(as_metrics(metrics)).tolist()


def _worst_first(m: np.ndarray) -> np.ndarray:
    """:func:`order_worst_first` of an array :func:`as_metrics` returned, as an int array."""
    return np.lexsort((-np.arange(m.size), _sort_key(m)))


def as_generator(rng: RngLike | None, what: str) -> np.random.Generator:
    """``rng`` itself if it is a Generator, else a new one seeded with it; ``what`` names the caller."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(int(rng))
    raise ConfigError(f"{what} needs rng= a non-negative int seed or a numpy Generator, got {rng!r}")


def _check_ranks(ranks: Sequence[int], n: int, what: str) -> frozenset[int]:
    out = frozenset(map(int, ranks))
    if out and (min(out) < 0 or max(out) >= n):
        bad = sorted(r for r in out if not 0 <= r < n)
        raise ConfigError(f"{what} names ranks {bad} outside the population 0..{n - 1}")
    return out


def worst_by_ratio(metrics: Sequence[float] | np.ndarray, ratio: float) -> list[int]:
    """The ``k = max(1, floor(n·ratio))`` worst agents, capped at ``n − 1``, as ascending ranks.

    At least one agent always survives, so a population of one replaces nobody. ``ratio`` must lie
    in the open interval (0, 1). Non-finite metrics (NaN, -inf, +inf) count as the worst; among equal
    metrics the higher rank is replaced first.
    """
    m = as_metrics(metrics)
    _check_fraction(ratio, "ratio")
    n = m.size
    k = min(max(1, math.floor(n * ratio + _RATIO_SLACK)), n - 1)
    return np.sort(_worst_first(m)[:k]).tolist()


def _is_real(value: object) -> bool:
    """A real number (numpy's included) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_fraction(value: float, name: str) -> None:
    if not _is_real(value) or not 0.0 < value < 1.0:
        raise ConfigError(f"{name} must be a number in the open interval (0, 1), got {value!r}; "
                          "e.g. 0.25 replaces the worst quarter")


def _last_replaced(last: Sequence[int | None] | Mapping[int, int] | None, n: int) -> list[int | None]:
    if last is None:
        return [None] * n
    if isinstance(last, Mapping):
        _check_ranks(list(last), n, "last_replaced")
        return [None if last.get(r) is None else int(last[r]) for r in range(n)]
    if len(last) != n:
        raise ConfigError(f"last_replaced has {len(last)} entries for {n} agents; give one per agent "
                          "(None = never replaced) or a mapping rank -> iteration")
    return [None if x is None else int(x) for x in last]


def below_threshold(metrics: Sequence[float] | np.ndarray, threshold: float,
                    last_replaced: Sequence[int | None] | Mapping[int, int] | None = None,
                    iteration: int | None = None, cooldown: int = 0) -> list[int]:
    """Agents whose metric is below ``threshold``, except those replaced within ``cooldown`` iterations.

    An agent replaced at iteration ``t`` is protected while ``iteration − t < cooldown``. Non-finite
    metrics count as below any threshold. If every agent qualifies, the best one is kept, so the
    result never holds all ``n`` ranks. Returns ascending ranks.
    """
    m = as_metrics(metrics)
    _check_threshold(threshold)
    _check_cooldown(cooldown)
    last = _last_replaced(last_replaced, m.size)
    if cooldown > 0 and iteration is None and any(t is not None for t in last):
        raise ConfigError("below_threshold with a cooldown needs iteration= the current iteration")
    below: list[int] = np.flatnonzero(_sort_key(m) < threshold).tolist()
    if cooldown == 0 or iteration is None:  # iteration is None only when nobody was replaced (above)
        chosen = below
    else:
        chosen = [r for r in below if (t := last[r]) is None or iteration - t >= cooldown]
    if len(chosen) == m.size:
        chosen.remove(order_worst_first(m)[-1])
    return chosen


def _check_threshold(threshold: float) -> None:
    if not _is_real(threshold) or not math.isfinite(threshold):
        raise ConfigError(f"threshold must be a finite number, got {threshold!r}; leave it None to disable")


def _check_cooldown(cooldown: int) -> None:
    if isinstance(cooldown, bool) or not isinstance(cooldown, (int, np.integer)) or cooldown < 0:
        raise ConfigError(f"cooldown must be a non-negative int (iterations), got {cooldown!r}")


class AgeState(NamedTuple):
    """Per-agent age rule state: agent ``r`` is due once ``ages[r] >= lifetimes[r]``.

    ``lifetimes[r]`` of generation ``g`` is drawn from ``age_range`` (inclusive) with a generator
    seeded by ``(seed, r, g)``, so every rank holding the same seed computes the same lifetimes
    without talking, whatever order replacements happen in.
    """

    ages: tuple[int, ...]
    lifetimes: tuple[int, ...]
    generations: tuple[int, ...]
    age_range: tuple[int, int]
    seed: int


def _check_age_range(age_range: Sequence[int]) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in age_range)
        ok = all(float(x) == int(x) for x in age_range) and 1 <= lo <= hi
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"age_range must be (low, high) integers with 1 <= low <= high, got {age_range!r}; "
                          "e.g. (50, 150) replaces each agent after 50 to 150 steps")
    return lo, hi


def _lifetime(seed: int, agent: int, generation: int, age_range: tuple[int, int]) -> int:
    lo, hi = age_range
    return int(np.random.default_rng([seed, agent, generation]).integers(lo, hi + 1))


def init_ages(n: int, age_range: Sequence[int], rng: RngLike) -> AgeState:
    """Start ``n`` agents at age 0, each with a lifetime drawn from ``age_range`` (inclusive)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"n must be a positive number of agents, got {n!r}")
    gen = as_generator(rng, "init_ages")
    seed = int(gen.integers(0, 2**63)) if isinstance(rng, np.random.Generator) else int(rng)
    bounds = _check_age_range(age_range)
    lifetimes = tuple(_lifetime(seed, r, 0, bounds) for r in range(n))
    return AgeState((0,) * n, lifetimes, (0,) * n, bounds, seed)


def due_by_age(state: AgeState) -> list[int]:
    """Ascending ranks whose age has reached their lifetime."""
    return [r for r, (a, life) in enumerate(zip(state.ages, state.lifetimes)) if a >= life]


def step_ages(state: AgeState, replaced: Sequence[int]) -> AgeState:
    """One step: ``replaced`` agents restart at age 0 with a new lifetime; every other agent ages by 1."""
    n = len(state.ages)
    gone = _check_ranks(replaced, n, "step_ages(replaced)")
    ages, lifetimes, gens = list(state.ages), list(state.lifetimes), list(state.generations)
    for r in range(n):
        if r in gone:
            gens[r] += 1
            ages[r] = 0
            lifetimes[r] = _lifetime(state.seed, r, gens[r], state.age_range)
        else:
            ages[r] += 1
    return state._replace(ages=tuple(ages), lifetimes=tuple(lifetimes), generations=tuple(gens))


@dataclass(frozen=True)
class ReplacementRule:
    """Which agents to replace: any combination of a ratio, a threshold with cooldown, and an age rule.

    ``mode="any"`` replaces an agent picked by at least one active rule, ``mode="all"`` only one
    picked by every active rule. ``cooldown`` protects recently replaced agents from the threshold
    rule only. Whatever the rules say, at least one agent (the best) always survives.
    """

    ratio: float | None = None
    threshold: float | None = None
    cooldown: int = 0
    age_range: tuple[int, int] | None = None
    mode: Literal["any", "all"] = "any"

    def __post_init__(self) -> None:
        if self.ratio is None and self.threshold is None and self.age_range is None:
            raise ConfigError("ReplacementRule needs at least one of ratio=, threshold= or age_range=")
        if self.ratio is not None:
            _check_fraction(self.ratio, "ratio")
        if self.threshold is not None:
            _check_threshold(self.threshold)
        _check_cooldown(self.cooldown)
        if self.cooldown and self.threshold is None:
            warnings.warn("ReplacementRule: cooldown only applies to the threshold rule and has no effect "
                          "without threshold=", stacklevel=3)
        if self.age_range is not None:
            object.__setattr__(self, "age_range", _check_age_range(self.age_range))
        if self.mode not in ("any", "all"):
            raise ConfigError(f"mode must be 'any' or 'all', got {self.mode!r}")


class SelectionState(NamedTuple):
    """What the rules remember between decisions: last replacement iteration per agent, and ages."""

    last_replaced: tuple[int | None, ...]
    ages: AgeState | None


def init_state(n: int, rule: ReplacementRule, rng: RngLike | None = None) -> SelectionState:
    """Fresh state for ``n`` agents; ``rng`` is required when ``rule`` has an age range."""
    if rule.age_range is None:
        return SelectionState((None,) * n, None)
    return SelectionState((None,) * n, init_ages(n, rule.age_range, as_generator(rng, "the age rule")))


def state_to_json(state: SelectionState) -> dict[str, Any]:
    """``state`` as JSON values (for checkpoints)."""
    ages = None if state.ages is None else {k: list(v) if isinstance(v, tuple) else v
                                           for k, v in state.ages._asdict().items()}
    return {"last_replaced": list(state.last_replaced), "ages": ages}


def state_from_json(data: Mapping[str, Any]) -> SelectionState:
    """The :class:`SelectionState` that :func:`state_to_json` wrote."""
    ages = data.get("ages")
    age_state = None if ages is None else AgeState(
        tuple(ages["ages"]), tuple(ages["lifetimes"]), tuple(ages["generations"]), (ages["age_range"][0],
                                                                                     ages["age_range"][1]),
        int(ages["seed"]))
    return SelectionState(tuple(data["last_replaced"]), age_state)


def update_state(state: SelectionState, replaced: Sequence[int], iteration: int) -> SelectionState:
    """State after ``replaced`` were replaced at ``iteration``.

    Ages step once per call, so call it at every iteration on which the age rule should tick (with
    ``replaced=()`` when nothing happened), not only on averaging iterations.
    """
    n = len(state.last_replaced)
    gone = _check_ranks(replaced, n, "update_state(replaced)")
    last = tuple(int(iteration) if r in gone else t for r, t in enumerate(state.last_replaced))
    ages = None if state.ages is None else step_ages(state.ages, sorted(gone))
    return SelectionState(last, ages)


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else f"{x} (non-finite counts as worst)"


def combine_rules(metrics: Sequence[float] | np.ndarray, rule: ReplacementRule, *,
                  iteration: int | None = None,
                  state: SelectionState | None = None) -> tuple[list[int], dict[int, str]]:
    """Apply every active rule of ``rule``; return ascending replaced ranks and a reason per rank."""
    m = as_metrics(metrics)
    n = m.size
    if state is not None and len(state.last_replaced) != n:
        raise ConfigError(f"state tracks {len(state.last_replaced)} agents but metrics has {n}")
    picks: list[dict[int, str]] = []
    values = m.tolist()
    if rule.ratio is not None:
        worst = worst_by_ratio(m, rule.ratio)
        picks.append(_metric_reasons(values, worst, f" among the worst {len(worst)} of {n}"))
    if rule.threshold is not None:
        last = None if state is None else state.last_replaced
        low = below_threshold(m, rule.threshold, last, iteration, rule.cooldown)
        picks.append(_metric_reasons(values, low, f" below threshold {rule.threshold:.4g}"))
    if rule.age_range is not None:
        if state is None or state.ages is None:
            raise ConfigError("the age rule needs state=init_state(n, rule, rng) carried between decisions")
        a = state.ages
        picks.append({r: f"age {a.ages[r]} reached lifetime {a.lifetimes[r]}" for r in due_by_age(a)})
    chosen = set(picks[0]).union(*picks[1:]) if rule.mode == "any" else set(picks[0]).intersection(*picks[1:])
    if len(chosen) == n:
        chosen.discard(order_worst_first(m)[-1])
    ranks = sorted(chosen)
    if len(picks) == 1:
        return ranks, {r: picks[0][r] for r in ranks}
    return ranks, {r: "; ".join(p[r] for p in picks if r in p) for r in ranks}


def _metric_reasons(values: list[float], ranks: list[int], tail: str) -> dict[int, str]:
    """``"metric <value><tail>"`` per rank. %-formatting Python floats is the fastest way to
    write a few hundred reasons (it gives the same text as ``f"{x:.4g}"``)."""
    pattern = "metric %.4g" + tail.replace("%", "%%")
    return {r: pattern % values[r] if math.isfinite(values[r]) else f"metric {_fmt(values[r])}{tail}"
            for r in ranks}


@dataclass(frozen=True)
class DonorRule:
    """Who donates: ``"all"`` valid others, the ``"best_k"`` best, or ``k`` drawn at ``"random"``."""

    kind: Literal["all", "best_k", "random"] = "all"
    k: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("all", "best_k", "random"):
            raise ConfigError(f"DonorRule kind must be 'all', 'best_k' or 'random', got {self.kind!r}")
        if self.kind != "all":
            _check_k(self.k)
        elif self.k is not None:
            warnings.warn("DonorRule(kind='all') ignores k", stacklevel=3)


def _check_k(k: int | None) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k must be a positive number of donors, got {k!r}")


def _candidates(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int]) -> list[int]:
    """Valid donors from best to worst: finite metric and not being replaced."""
    m = as_metrics(metrics)
    gone = _check_ranks(replaced, m.size, "replaced")
    usable = np.isfinite(m)
    usable[np.fromiter(gone, dtype=np.intp, count=len(gone))] = False
    best_first = _worst_first(m)[::-1]
    return best_first[usable[best_first]].tolist()


def donors_all_others(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int]) -> list[int]:
    """Every agent that is neither replaced nor non-finite, as ascending ranks (may be empty)."""
    return donors_from_pool(_candidates(metrics, replaced), DonorRule("all"))


def donors_best_k(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int], k: int) -> list[int]:
    """The ``k`` best valid donors (fewer if fewer exist), as ascending ranks; ties prefer lower ranks."""
    _check_k(k)
    return donors_from_pool(_candidates(metrics, replaced), DonorRule("best_k", k))


def donors_random(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int], k: int,
                  rng: RngLike | None) -> list[int]:
    """``k`` valid donors drawn uniformly without replacement (all of them if fewer), ascending.
    ``rng`` is required when there is a choice to make (ConfigError if it is None then)."""
    _check_k(k)
    return donors_from_pool(_candidates(metrics, replaced), DonorRule("random", k), rng)


def valid_donors(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int]) -> list[int]:
    """The pool every donor rule draws from: finite, not replaced, best first (compute once per decision)."""
    return _candidates(metrics, replaced)


def donors_from_pool(pool: Sequence[int], rule: DonorRule, rng: RngLike | None = None) -> list[int]:
    """Apply ``rule`` to ``pool`` (valid donors, best first): ascending ranks."""
    if rule.kind == "all":
        return sorted(pool)
    assert rule.k is not None  # DonorRule checked k for every kind but "all"
    if rule.kind == "best_k":
        return sorted(pool[:rule.k])
    return draw_donors(sorted(pool), rule.k, rng)


def draw_donors(ordered: Sequence[int], k: int, rng: RngLike | None) -> list[int]:
    """``k`` of ``ordered`` (ascending valid donors) drawn uniformly without replacement, ascending;
    all of them, drawing nothing, when there are at most ``k``. One row of :func:`draw_donor_rows`."""
    return draw_donor_rows(ordered, k, 1, rng)[0].tolist()


def draw_donor_rows(ordered: Sequence[int], k: int, count: int, rng: RngLike | None) -> np.ndarray:
    """``count`` independent draws of ``k`` of ``ordered`` (ascending), one ascending row each.

    Floyd's algorithm, vectorised across the rows: for ``j`` from ``n - k`` to ``n - 1``, one call
    ``integers(0, j + 1, size=count)`` on the Generator gives each row a position ``t``; a row that
    already holds ``t`` takes ``j`` instead. Every k-subset is equally likely, and the cost is
    O(count * k^2) whatever ``n`` (one permutation per row made a 1,024-agent decision cost ms).
    With ``n <= k`` every row is all of ``ordered`` and nothing is drawn.
    """
    pool = np.asarray(ordered, dtype=np.intp)
    n = int(pool.size)
    if n <= k:
        return np.tile(pool, (count, 1))
    gen = as_generator(rng, "donors_random")
    picks = np.empty((count, k), dtype=np.intp)
    for column, j in enumerate(range(n - k, n)):
        t = gen.integers(0, j + 1, size=count)
        if column:
            t = np.where((picks[:, :column] == t[:, None]).any(axis=1), j, t)
        picks[:, column] = t
    picks.sort(axis=1)
    return pool[picks]


def select_donors(metrics: Sequence[float] | np.ndarray, replaced: Sequence[int], rule: DonorRule,
                  rng: RngLike | None = None) -> list[int]:
    """Dispatch on ``rule.kind``; ``rng`` is only needed (and required) for ``"random"``."""
    if rule.kind == "all":
        return donors_all_others(metrics, replaced)
    assert rule.k is not None  # DonorRule checked k for every kind but "all"
    if rule.kind == "best_k":
        return donors_best_k(metrics, replaced, rule.k)
    return donors_random(metrics, replaced, rule.k, rng)
