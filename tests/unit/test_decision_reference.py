"""decide() against a plain reference written from the documented rules, on random populations.

decide() shares one donor plan among the replaced ranks of a deterministic rule and skips the
per-entry conversions of Decision.__init__ (it must stay under 1 ms at 1,024 agents, see
docs/scaling.md); the reference below does everything per rank with plain Python, as the
docstrings of popmesh.population.decisions.selection and combine state it. Every decision must agree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from popmesh.core.errors import ConfigError
from popmesh.population import Decision, DonorRule, ReplacementRule, decide, init_state, update_state
from popmesh.population.decisions.selection import SelectionState

NAN, INF = float("nan"), float("inf")


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else f"{x} (non-finite counts as worst)"


def _selected(m: list[float], rule: ReplacementRule, it: int, state: SelectionState) -> dict[int, str]:
    """Who is replaced, and why: worse = lower metric (non-finite lowest), then higher rank."""
    n = len(m)
    score = [x if math.isfinite(x) else -INF for x in m]
    worst_first = sorted(range(n), key=lambda r: (score[r], -r))
    picks: list[dict[int, str]] = []
    if rule.ratio is not None:
        k = min(max(1, math.floor(n * rule.ratio + 1e-9)), n - 1)
        picks.append({r: f"metric {_fmt(m[r])} among the worst {k} of {n}" for r in worst_first[:k]})
    if rule.threshold is not None:
        low = [r for r in range(n) if score[r] < rule.threshold and (
            state.last_replaced[r] is None or rule.cooldown == 0 or it - state.last_replaced[r] >= rule.cooldown)]
        if len(low) == n:
            low.remove(worst_first[-1])
        picks.append({r: f"metric {_fmt(m[r])} below threshold {rule.threshold:.4g}" for r in low})
    if rule.age_range is not None:
        ages = state.ages
        assert ages is not None
        picks.append({r: f"age {ages.ages[r]} reached lifetime {ages.lifetimes[r]}"
                      for r in range(n) if ages.ages[r] >= ages.lifetimes[r]})
    sets = [set(p) for p in picks]
    chosen = set.union(*sets) if rule.mode == "any" else set.intersection(*sets)
    if len(chosen) == n:
        chosen.discard(worst_first[-1])
    return {r: "; ".join(p[r] for p in picks if r in p) for r in sorted(chosen)}


def _rank_weights(values: list[float]) -> list[float]:
    ranks = [sum(v < x for v in values) + (sum(v == x for v in values) + 1) / 2 for x in values]
    return [r / sum(ranks) for r in ranks]


def _floyd_draws(ordered: list[int], k: int, count: int, seed: int) -> list[list[int]]:
    """Random donors as documented: Floyd's algorithm for every replaced rank at once, one
    ``integers(0, j + 1, size=count)`` per j in n-k..n-1; a position a rank already holds becomes j."""
    gen, rows = np.random.default_rng(seed), [[] for _ in range(count)]
    for j in range(len(ordered) - k, len(ordered)):
        for row, t in zip(rows, gen.integers(0, j + 1, size=count).tolist()):
            row.append(j if t in row else t)
    return [sorted(ordered[t] for t in row) for row in rows]


def reference(m: list[float], rule: ReplacementRule, donor_rule: DonorRule, strategy: str, policy: str,
              it: int, state: SelectionState, seed: int) -> dict[str, object]:
    why = _selected(m, rule, it, state)
    score = [x if math.isfinite(x) else -INF for x in m]
    pool = [r for r in sorted(range(len(m)), key=lambda r: (-score[r], r))
            if r not in why and math.isfinite(m[r])]
    out: dict[str, dict[int, object]] = {"donors": {}, "weights": {}, "copy": {}, "skipped": {}}
    drawn = _floyd_draws(sorted(pool), donor_rule.k or 0, len(why), seed) if (
        donor_rule.kind == "random" and len(pool) > (donor_rule.k or 0)) else []
    for i, r in enumerate(why):
        if strategy == "reset_weights":
            out["donors"][r], out["weights"][r], out["copy"][r] = (), (), None
            continue
        if donor_rule.kind == "all":
            donors = sorted(pool)
        elif donor_rule.kind == "best_k":
            donors = sorted(pool[:donor_rule.k])
        elif len(pool) <= (donor_rule.k or 0):
            donors = sorted(pool)
        else:
            donors = drawn[i]
        if not donors:
            out["skipped"][r] = "no valid donor: every other agent is being replaced or has a non-finite metric"
            continue
        best = max(donors, key=lambda d: (m[d], -d))
        if strategy == "best_only":
            donors, weights = [best], [1.0]
        elif strategy == "mean":
            weights = [1 / len(donors)] * len(donors)
        else:
            weights = _rank_weights([m[d] for d in donors])
        out["donors"][r], out["weights"][r] = tuple(donors), tuple(weights)
        out["copy"][r] = best if policy == "copy" else None
    replaced = [r for r in why if r not in out["skipped"]]
    return {"replaced": tuple(replaced), "reasons": {r: why[r] for r in replaced}, **out}


RULES = [
    ReplacementRule(ratio=0.25),
    ReplacementRule(ratio=0.6),
    ReplacementRule(threshold=0.0, cooldown=3),
    ReplacementRule(threshold=0.5),
    ReplacementRule(ratio=0.3, threshold=-0.5, cooldown=2, mode="all"),
    ReplacementRule(ratio=0.2, age_range=(2, 4)),
]
DONORS = [DonorRule("all"), DonorRule("best_k", 1), DonorRule("best_k", 3), DonorRule("random", 2)]
STRATEGIES = ["mean", "weighted_mean", "best_only", "reset_weights"]


def _metrics(gen: np.random.Generator, n: int) -> list[float]:
    m = np.round(gen.normal(size=n), int(gen.integers(0, 3)))  # rounding makes ties
    bad = gen.random(n) < gen.choice([0.0, 0.1, 0.9])
    m[bad] = gen.choice([NAN, INF, -INF], size=int(bad.sum()))
    return [float(x) for x in m]


@pytest.mark.parametrize("case", range(48))
def test_decide_matches_the_plain_reference(case):
    gen = np.random.default_rng(case)
    rule, donor_rule = RULES[case % len(RULES)], DONORS[(case // len(RULES)) % len(DONORS)]
    strategy, policy = STRATEGIES[case % len(STRATEGIES)], ["reset", "keep", "copy"][case % 3]
    n = int(gen.choice([1, 2, 3, 7, 40, 300]))
    state = init_state(n, rule, rng=case)
    for it in range(4):
        m = _metrics(gen, n)
        seed = case * 10 + it
        d = decide(m, rule, donor_rule, strategy, iteration=it, state=state, rng=seed, optimizer_policy=policy)
        want = reference(m, rule, donor_rule, strategy, policy, it, state, seed)
        assert d.replaced == want["replaced"] and d.reasons == want["reasons"]
        assert d.donors == want["donors"] and d.copy_optimizer_from == want["copy"]
        assert d.skipped == want["skipped"]
        assert d.weights.keys() == want["weights"].keys()
        for r, w in want["weights"].items():
            assert d.weights[r] == pytest.approx(w, rel=1e-12, abs=1e-15)
        # the shortcut constructor gives what the checking one gives, and survives a JSON round trip
        fields = {k: getattr(d, k) for k in Decision.__dataclass_fields__}
        assert Decision(**fields) == d == Decision.from_dict(d.to_dict())
        state = update_state(state, d.replaced, it)


def test_deterministic_rules_share_one_plan_and_stay_linear():
    """Averaging all others at 1,024 agents: one donor tuple shared by all 256 replaced ranks."""
    m = np.random.default_rng(0).normal(size=1024)
    d = decide(m, ReplacementRule(ratio=0.25), DonorRule("all"), "mean")
    assert len(d.replaced) == 256 and len({id(v) for v in d.donors.values()}) == 1
    assert d.donors[d.replaced[0]] == tuple(r for r in range(1024) if r not in d.replaced)


@pytest.mark.parametrize("change, match", [
    (lambda f: f["weights"].update({3: (0.7, 0.2)}), "rank 3: weights .* sum to 1"),
    (lambda f: f["copy_optimizer_from"].update({3: 7}), "rank 3 copies .* not one of its donors"),
])
def test_the_shared_plan_check_still_sees_one_odd_rank(change, match):
    """Decision() checks a rank whose plan differs from the others', not only the first."""
    donors = (0, 1)
    fields = dict(replaced=(2, 3), donors={2: donors, 3: donors}, weights={2: (0.5, 0.5), 3: (0.5, 0.5)},
                  copy_optimizer_from={2: None, 3: None}, strategy="mean")
    change(fields)
    with pytest.raises(ConfigError, match=match):
        Decision(**fields)
