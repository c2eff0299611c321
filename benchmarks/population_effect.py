"""Does the population help? Env steps until the best agent's mean return (last 20 episodes)
reaches 475 on CartPole-v1, policy `async` vs `none`, 4 ranks on torch/gloo, over several seeds.

Run: .venv/bin/python benchmarks/population_effect.py [--seeds 5] [--first-seed 0] [--steps 150000]
Each run is `popmesh demo --stop-at-target`; its summary.json says which rank got there and when.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(policy: str, seed: int, steps: int, ranks: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "popmesh", "demo", "--policy", policy, "--seed", str(seed), "--steps", str(steps),
               "--ranks", str(ranks), "--stop-at-target", "--no-live", "--out", out, *extra]
        subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL)
        summary = json.loads(next(Path(out).glob("*/summary.json")).read_text())
    reached = summary["reached_target"]
    return {"policy": policy, "seed": seed, "steps": reached["agent_steps"] if reached else None,
            "replacements": summary["replacements"]}


def describe(values: list[int | None], cap: int) -> str:
    hit = [v for v in values if v is not None]
    misses = len(values) - len(hit)
    if not hit:
        return f"never within {cap:,} steps"
    spread = f"{min(hit):,}–{max(hit):,}"
    return f"median {statistics.median(hit):,.0f} (range {spread}){f', {misses} never' if misses else ''}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--steps", type=int, default=150_000, help="cap on env steps per agent")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--policies", default="async,none", help="comma-separated demo policies to compare")
    parser.add_argument("demo_args", nargs="*",
                        help="extra `popmesh demo` options after --, e.g. -- --strategy best_only")
    ns = parser.parse_args()
    rows = []
    for seed in range(ns.first_seed, ns.first_seed + ns.seeds):
        for policy in ns.policies.split(","):
            rows.append(run_once(policy, seed, ns.steps, ns.ranks, ns.demo_args))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| policy | steps to 475 (best agent, per-agent env steps) | per seed |")
    print("|---|---|---|")
    for policy in ns.policies.split(","):
        values = [r["steps"] for r in rows if r["policy"] == policy]
        per_seed = ", ".join("—" if v is None else f"{v:,}" for v in values)
        print(f"| {policy} | {describe(values, ns.steps)} | {per_seed} |")


if __name__ == "__main__":
    main()
