"""The population coordinator's decision at scale: pure code, one core, no communication.

Goal (docs/scaling.md): under 1 ms per decision for 1,024 agents. The asynchronous policy's
coordinator runs ``decide`` once per decision for the whole population, so its cost grows with
the number of agents; everything else a decision costs is messages (see docs/population.md).

For each rule it prints, in the same run: the median time per decision of ``decide`` and of a
per-rank reference (every replaced rank planned on its own and the Decision built by the checking
constructor, the straightforward way; ``decide`` shares one plan among the replaced ranks; both
must give the same decision, checked every round), their ratio, the bytes of the coordinator's
decision messages (largest message and total over the ranks involved) when each rank gets its
part against the whole decision sent to every involved rank, and the weight streams one
decision moves.

    python benchmarks/population_decision.py [--agents 64,1024,4096] [--params 84000] [--reps 50]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from typing import Any

import numpy as np

from popmesh.population import Decision, DonorRule, ReplacementRule, decide
from popmesh.population.decisions.combine import OptimizerPolicy, Strategy, averaging_weights, optimizer_action
from popmesh.population.decisions.selection import (
    as_generator,
    combine_rules,
    donors_from_pool,
    draw_donor_rows,
    init_state,
    update_state,
    valid_donors,
)
from popmesh.population.mechanisms.asynchronous.protocol import decision_messages, involved

RULES = {
    "worst 25 %, mean of all others": (ReplacementRule(ratio=0.25), DonorRule("all"), "mean"),
    "worst 25 %, mean of best 2": (ReplacementRule(ratio=0.25), DonorRule("best_k", 2), "mean"),
    "worst 25 %, best only": (ReplacementRule(ratio=0.25), DonorRule("best_k", 1), "best_only"),
    "threshold + cooldown, best 2": (ReplacementRule(threshold=0.0, cooldown=5), DonorRule("best_k", 2), "mean"),
    "worst 25 %, 2 random donors": (ReplacementRule(ratio=0.25), DonorRule("random", 2), "mean"),
}


def per_rank_reference(metrics: Any, rule: ReplacementRule, donor_rule: DonorRule, strategy: str, *,
                       iteration: int, state: Any, rng: int) -> Decision:
    """``decide`` planned rank by rank: its own donor list, weights and optimizer source per replaced
    rank, new tuples each, and the Decision built by its checking constructor."""
    m = np.asarray(metrics, dtype=np.float64)
    strat, policy = Strategy.parse(strategy), OptimizerPolicy.RESET
    gen = as_generator(rng, "random donors") if donor_rule.kind == "random" else None
    selected, why = combine_rules(m, rule, iteration=iteration, state=state)
    pool = valid_donors(m, selected)
    replaced, donors, weights, source, skipped = [], {}, {}, {}, {}
    drawn = draw_donor_rows(sorted(pool), donor_rule.k or 0, len(selected), gen).tolist() if gen else []
    for i, r in enumerate(selected):
        ds = drawn[i] if gen else donors_from_pool(pool, donor_rule)
        if not ds:
            skipped[r] = "no valid donor: every other agent is being replaced or has a non-finite metric"
            continue
        ws = averaging_weights(m, ds, strat)
        if strat is Strategy.BEST_ONLY:
            ds, ws = [d for d, w in zip(ds, ws) if w > 0], (1.0,)
        replaced.append(r)
        donors[r], weights[r] = tuple(ds), tuple(ws)
        source[r] = optimizer_action(policy, r, ds, ws, metrics=m)
    summary = (f"replace {len(replaced)} of {m.size} agents {replaced} by {strat.value}" if replaced else
               "no replacement: no valid donor" if skipped else "no replacement: no agent selected")
    summary += f"; skipped {sorted(skipped)} (no valid donor)" if replaced and skipped else ""
    return Decision(tuple(replaced), donors, weights, source, strat.value, policy.value,
                    reasons={r: why[r] for r in replaced}, skipped=skipped, iteration=iteration, summary=summary)


def _time(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds of one call, started after a full garbage collection: the per-rank reference
    leaves O(n²) objects behind, whose collection would otherwise land in whichever call came next."""
    gc.collect()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def per_decision(n: int, rule: ReplacementRule, donors: DonorRule, strategy: str, reps: int) -> dict[str, Any]:
    """Median seconds per decision (popmesh and the per-rank reference, alternating) over rounds of
    fresh metrics, the last decision, and its metrics."""
    rng = np.random.default_rng(n)
    state = init_state(n, rule, rng=0)
    fast, slow = [], []
    decision, metrics = None, None
    for it in range(reps):
        metrics = rng.normal(size=n)
        args: dict[str, Any] = dict(iteration=it, state=state, rng=it)
        t_fast, decision = _time(decide, metrics, rule, donors, strategy, **args)
        if n <= 1024 or it < 5:  # the reference of "all others" takes seconds at 4,096 agents
            t_slow, reference = _time(per_rank_reference, metrics, rule, donors, strategy, **args)
            assert reference == decision, f"{n} agents, round {it}: the decisions differ"
            slow.append(t_slow)
        fast.append(t_fast)
        state = update_state(state, decision.replaced, it)
    assert decision is not None and metrics is not None
    return {"fast": statistics.median(fast), "slow": statistics.median(slow), "decision": decision,
            "metrics": metrics.tolist()}


def message_bytes(decision: Decision, metrics: list[float]) -> tuple[int, int, int, int]:
    """(largest, total) JSON bytes of the decision messages: each rank's part, then the whole
    decision (plus ranks and metrics) sent to every involved rank instead."""
    n = len(metrics)
    parts = [len(json.dumps(m)) for m in decision_messages(decision, metrics).values()]
    whole = len(json.dumps({"kind": "decision", "decision": decision.to_dict(), "ranks": list(range(n)),
                            "metrics": [m if math.isfinite(m) else None for m in metrics]}))
    count = len(involved(decision))
    return max(parts, default=0), sum(parts), whole if count else 0, whole * count


def _size(b: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="64,1024,4096")
    parser.add_argument("--params", type=int, default=84_000, help="parameters per agent (float32), for bytes moved")
    parser.add_argument("--reps", type=int, default=50)
    opts = parser.parse_args()
    print(f"{'rule':30} {'agents':>6} {'decide':>9} {'per-rank':>10} {'speed-up':>8}   "
          f"{'largest msg':>11} {'(whole)':>9} {'all msgs':>9} {'(whole)':>9} {'streams':>9}")
    for name, (rule, donors, strategy) in RULES.items():
        for n in [int(x) for x in opts.agents.split(",")]:
            r = per_decision(n, rule, donors, strategy, opts.reps)
            d = r["decision"]
            largest, total, whole, whole_total = message_bytes(d, r["metrics"])
            streams = sum(len(d.donors[x]) for x in d.replaced) * opts.params * 4
            print(f"{name:30} {n:6,} {r['fast'] * 1e3:6.3f} ms {r['slow'] * 1e3:7.3f} ms "
                  f"{r['slow'] / r['fast']:7.1f}x   {_size(largest):>11} {_size(whole):>9} "
                  f"{_size(total):>9} {_size(whole_total):>9} {_size(streams):>9}")
    print(f"(median of {opts.reps} decisions on fresh metrics; messages: JSON down to the involved ranks, "
          f"'(whole)' = the whole decision to each instead; streams: weights moved, {opts.params:,} "
          "float32 parameters per agent)")


if __name__ == "__main__":
    main()
