"""The population coordinator's decision at scale: pure code, one core, no communication.

Goal (docs/scaling.md): under 1 ms per decision for 1,024 agents. The asynchronous policy's
coordinator runs ``decide`` once per decision for the whole population, so its cost grows with
the number of agents; everything else a decision costs is messages (see docs/population.md).
Prints the median time per decision for the rules popmesh ships, and the bytes a decision moves.

    python benchmarks/population_decision.py [--agents 4,64,1024,4096] [--params 84000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from popmesh.population import DonorRule, ReplacementRule, decide
from popmesh.population.selection import init_state, update_state

RULES = {
    "worst 25 %, mean of all others": (ReplacementRule(ratio=0.25), DonorRule("all"), "mean"),
    "worst 25 %, mean of best 2": (ReplacementRule(ratio=0.25), DonorRule("best_k", 2), "mean"),
    "worst 25 %, best only": (ReplacementRule(ratio=0.25), DonorRule("best_k", 1), "best_only"),
    "threshold + cooldown": (ReplacementRule(threshold=0.0, cooldown=5), DonorRule("best_k", 2), "mean"),
}


def per_decision(n: int, rule: ReplacementRule, donors: DonorRule, strategy: str, reps: int = 50) -> tuple[float, int]:
    """Median seconds per decision over ``reps`` rounds of fresh metrics, and streams per decision."""
    rng = np.random.default_rng(n)
    state = init_state(n, rule, rng=0)
    times, streams = [], 0
    for it in range(reps):
        metrics = rng.normal(size=n)
        start = time.perf_counter()
        decision = decide(metrics, rule, donors, strategy, iteration=it, state=state, rng=it)
        times.append(time.perf_counter() - start)
        state = update_state(state, decision.replaced, it)
        streams = sum(len(decision.donors[r]) for r in decision.replaced)
    return statistics.median(times), streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="4,64,1024,4096")
    parser.add_argument("--params", type=int, default=84_000, help="parameters per agent (float32), for bytes moved")
    opts = parser.parse_args()
    sizes = [int(n) for n in opts.agents.split(",")]
    print(f"{'rule':34}" + "".join(f"{n:>14,} agents" for n in sizes))
    for name, (rule, donors, strategy) in RULES.items():
        cells = []
        for n in sizes:
            seconds, streams = per_decision(n, rule, donors, strategy)
            cells.append(f"{seconds * 1e3:9.3f} ms {streams * opts.params * 4 / 1e6:7.0f} MB")
        print(f"{name:34}" + "".join(f"{c:>21}" for c in cells))
    print(f"(time per decision, median of 50; MB: weight streams one decision moves, {opts.params:,} float32 "
          "parameters per agent)")


if __name__ == "__main__":
    main()
