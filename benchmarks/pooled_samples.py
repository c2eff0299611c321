"""For scale on CartPole: how soon can the demo's PPO learner reach 475 when it learns from all four agents'
samples at once, against the same learner alone?

* **alone**: one `popmesh.demo.learner.PPOLearner` (8 environments x 64 steps = 512 env steps an iteration),
  at the learner's own sound choice (learning rate 2.5e-3, entropy coefficient 0.01);
* **pooled**: one policy trained on four agents' samples (32 environments: 2,048 env steps an iteration,
  4 epochs of 4 minibatches of 512), as four data-parallel agents whose gradients are averaged would be.
  The target is read on one agent's own 8 environments (its last 20 episodes), and its steps are that
  agent's own 512 an iteration, as `benchmarks/population_vs_pbt.py` counts a population's.

Both start from the same weights per seed, seeds interleaved. No population policy reaches the target
sooner than its agents can learn; pooling every sample into one policy is one measure of how soon that
is. One process, one thread.

    python benchmarks/pooled_samples.py [--seeds 10] [--first-seed 0] [--iterations 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from _pbt_tables import sign_test
from popmesh.demo.learner import WINDOW, Hyper, PPOLearner

OWN_ENVS = 8  # one agent's environments: the target is read on these
TARGET = 475.0


class PooledLearner(PPOLearner):
    """The learner on four agents' environments, whose metric counts one agent's episodes only."""

    def _track_returns(self, reward: np.ndarray, done: np.ndarray) -> list[float]:
        self.running += reward
        ended = [float(r) for r in self.running[:OWN_ENVS][done[:OWN_ENVS] > 0]]
        self.recent.extend(ended)
        self.running[done > 0] = 0.0
        return ended


def run(kind: str, seed: int, iterations: int) -> dict[str, Any]:
    """Iterations until the agent's own last 20 episodes average 475 (None: not within ``iterations``)."""
    hyper = Hyper(lr=2.5e-3, entropy=0.01)
    agent = PPOLearner(seed, hyper, init_seed=seed) if kind == "alone" else \
        PooledLearner(seed, Hyper(lr=2.5e-3, entropy=0.01, num_envs=4 * OWN_ENVS), init_seed=seed)
    began, reached = time.monotonic(), 0
    for iteration in range(1, iterations + 1):
        agent.iterate()
        if len(agent.recent) == WINDOW and agent.mean_return() >= TARGET:
            reached = iteration
            break
    agent.close()
    own = OWN_ENVS * hyper.rollout
    return {"kind": kind, "seed": seed, "steps": reached * own if reached else None, "wall": time.monotonic() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=300, help="the budget; a run past it counts as never")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("alone", "pooled")
    runs: dict[str, dict[int, dict[str, Any]]] = {k: {} for k in kinds}
    for seed in range(opts.first_seed, opts.first_seed + opts.seeds):
        for kind in kinds if seed % 2 == 0 else kinds[::-1]:
            runs[kind][seed] = run(kind, seed, opts.iterations)
        print(f"seed {seed}: " + "; ".join(f"{k} {runs[k][seed]['steps']}" for k in kinds), flush=True)
    never = opts.iterations * OWN_ENVS * Hyper().rollout
    print(f"\nCartPole-v1, target {TARGET:g} over one agent's last {WINDOW} episodes; steps: that agent's own "
          f"(never: counted as the budget, {never:,})")
    print("| learner | steps to 475, median (range) | reached |")
    print("|---|---|---|")
    for kind in kinds:
        steps = [r["steps"] or never for r in runs[kind].values()]
        hit = sum(r["steps"] is not None for r in runs[kind].values())
        print(f"| {kind} | {statistics.median(steps):,.0f} ({min(steps):,}-{max(steps):,}) | {hit} of {len(steps)} |")
    print("\n| seed | " + " | ".join(kinds) + " |")
    print("|---|---|---|")
    for seed in runs["alone"]:
        print(f"| {seed} | " + " | ".join(f"{runs[k][seed]['steps'] or 'never'}" for k in kinds) + " |")
    pairs = [(runs["pooled"][s]["steps"] or never, runs["alone"][s]["steps"] or never) for s in runs["alone"]]
    wins, losses = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
    ratio = statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)
    print(f"pooled against alone: {ratio:.2f}x the median steps; fewer in {wins} seeds, more in {losses} "
          f"(sign test p = {sign_test(wins, losses):.2f})")


if __name__ == "__main__":
    main()
