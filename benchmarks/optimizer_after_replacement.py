"""What a replaced agent's optimizer should start from: a fresh Adam (`reset`), its own state (`keep`), or
its best donor's (`copy`, streamed with the weights), measured on `popmesh demo`'s population.

For each seed the three settings run one after another (every other seed in reverse order), each
`popmesh demo --stop-at-target --optimizer SETTING` with the task's initial ranges and the demo's
default asynchronous policy, 4 agents. Per run: the steps an agent needed to reach the target
(a miss counts as the budget), and the **recovery** of the replaced agents: for every replacement,
the replaced agent's mean return 10 iterations after it applied the replacement minus its best
donor's mean return at the decision (0: it goes on as well as the donor it copied; below: the dip
that the optimizer's start costs), as a median over the run's replacements.

    python benchmarks/optimizer_after_replacement.py [--task cartpole-wide] [--seeds 5] [--first-seed 0]
    python benchmarks/optimizer_after_replacement.py --results LOG...   # the tables of earlier calls

Figures: docs/population.md (Optimizer state).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _pbt_tables import charged_steps, median_range, sign_test
from _ray_pbt import read_jsonl
from population_vs_pbt import TASKS, Plan, run_popmesh

SETTINGS = ("reset", "keep", "copy")
AFTER = 10  # iterations after the replacement at which the replaced agent is measured

Run = dict[str, Any]


def recovery(folder: Path) -> float | None:
    """The median over a run's replacements of (replaced agent's return AFTER iterations later) minus
    (its best donor's return at the decision); None without a replacement that far from the end."""
    run = next(folder.glob("*/summary.json")).parent
    returns = {(r["rank"], r["iteration"]): r["mean_return"] for r in read_jsonl(run / "history.jsonl")}
    gaps = []
    for event in read_jsonl(run / "events.jsonl"):
        if "kind" in event:
            continue
        donors = [returns.get((d, event["decided_at"])) for d in event["donors"]]
        after = returns.get((event["rank"], event["iteration"] + AFTER))
        known = [d for d in donors if d is not None]
        if known and after is not None:
            gaps.append(after - max(known))
    return round(statistics.median(gaps), 1) if gaps else None


def run_setting(setting: str, plan: Plan) -> Run:
    with tempfile.TemporaryDirectory(prefix="optimizer-") as tmp:
        run = run_popmesh("popmesh", Plan(plan.task, plan.seed, plan.budget, plan.every, plan.warmup,
                                          demo_args=("--optimizer", setting)), Path(tmp))
        return {**run, "optimizer": setting, "recovery": recovery(Path(tmp))}


def table(runs: list[Run]) -> str:
    """Per setting: steps to the target and recovery (median and range), then each against reset."""
    lines = ["| optimizer | runs | steps to target (agent) | missed | recovery after 10 iterations |",
             "|---|---|---|---|---|"]
    by = {s: [r for r in runs if r["optimizer"] == s] for s in SETTINGS}
    for setting, rs in by.items():
        steps = median_range([charged_steps(r) for r in rs])
        rec = median_range([r["recovery"] for r in rs if r["recovery"] is not None])
        lines.append(f"| {setting} | {len(rs)} | " + ("—" if steps is None else f"{steps[0]:,.0f} ({steps[1]:,.0f}–"
                     f"{steps[2]:,.0f})") + f" | {sum(r['steps'] is None for r in rs)} | "
                     + ("—" if rec is None else f"{rec[0]:+.1f} ({rec[1]:+.1f} to {rec[2]:+.1f})") + " |")
    lines += ["", "| against reset | fewer steps | more | equal | sign test p |", "|---|---|---|---|---|"]
    base = {r["seed"]: charged_steps(r) for r in by["reset"]}
    for setting in SETTINGS[1:]:
        pairs = [(charged_steps(r), base[r["seed"]]) for r in by[setting] if r["seed"] in base]
        wins, losses = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
        ties = len(pairs) - wins - losses
        lines.append(f"| {setting} | {wins} | {losses} | {ties} | {sign_test(wins, losses):.3g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--task", choices=tuple(TASKS), default="cartpole-wide")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150_000, help="budget: env steps per agent")
    parser.add_argument("--results", type=Path, nargs="+", metavar="LOG", help="tabulate earlier calls' JSON lines")
    ns = parser.parse_args()
    if ns.results:
        print(table([r for log in ns.results for r in read_jsonl(log) if "optimizer" in r]))
        return
    runs = []
    for i, seed in enumerate(range(ns.first_seed, ns.first_seed + ns.seeds)):
        plan = Plan(TASKS[ns.task], seed, ns.steps, 10, 20)
        for setting in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            runs.append(run_setting(setting, plan))
            print(json.dumps(runs[-1]), flush=True)
    print("\n" + table(runs))


if __name__ == "__main__":
    sys.exit(main())
