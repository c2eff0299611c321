"""The statistics and tables of benchmarks/population_vs_pbt.py: pure functions over its runs (one dict
per run, as its JSON lines hold them), no processes.

A run that never reached the target counts as the budget: its steps as the step cap per agent, its
wall time as the whole run's. Every median, range, worst seed, sign test and goal below uses those
charged values, so a contender that misses is not flattered by leaving its misses out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

Run = dict[str, Any]

# Every contender, in the order the tables list them, with what it runs.
CONTENDERS: dict[str, str] = {
    "popmesh": "`popmesh demo`: asynchronous selective averaging (policy async, decide latest): an agent is "
               "judged the moment it reports, against every member's latest report; one in the bottom half "
               "that trails the best by both gaps takes the best agent's weights, its learning "
               "rate and entropy coefficient explored; nobody waits for anybody",
    "popmesh-shared": "`popmesh demo --share-samples`: the same, each agent also learning from the others' "
                      "rollouts (decoupled PPO with V-trace; on the hypergrid, from their trajectories)",
    "popmesh-complete": "`popmesh demo --decide complete`: the same policy deciding once every agent has "
                        "reported an iteration",
    "none": "`popmesh demo --policy none`: the same agents, no population policy",
    "shared-none": "`popmesh demo --policy none --share-samples`: the agents learn from each other's rollouts, "
                   "no population policy",
    "ray-pbt": "Ray Tune PopulationBasedTraining: the same learner as a function trainable, 4 trials, "
               "asynchronous, one donor's checkpoint copied, learning rate and entropy coefficient explored",
    "ray-pb2": "Ray Tune PB2: as ray-pbt, the new values chosen by PB2's GP bandit within the ranges "
               "(on a log scale)",
}
OURS = ("popmesh", "popmesh-shared")  # the popmesh contenders the comparisons and goals are for
STEP_GOAL = 0.8  # popmesh's median steps at most this fraction of each of STEP_RIVALS'
STEP_RIVALS = ("ray-pbt", "ray-pb2", "none")
WALL_GOAL = 0.7  # popmesh's median wall time at most this fraction of each of WALL_RIVALS'
WALL_RIVALS = ("ray-pbt", "ray-pb2")


class Comparison(NamedTuple):
    """popmesh against one other contender over the seeds both ran: per-seed counts of popmesh's
    steps being fewer, more or equal, the two-sided sign test's p (ties dropped), and popmesh's
    median over the other's, for steps and for wall time."""

    seeds: int
    fewer: int
    more: int
    equal: int
    p: float
    steps_ratio: float
    wall_ratio: float


def charged_steps(run: Run) -> int:
    """The agent's steps to the target, or the budget (step cap per agent) where it never got there."""
    return int(run["steps"]) if run["steps"] is not None else int(run["budget"])


def charged_wall(run: Run) -> float:
    """Seconds from the process start to the target, or the whole run's where it never got there."""
    return float(run["wall_s"]) if run["wall_s"] is not None else float(run["total_s"])


def median_range(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of ``values``; None for none."""
    return (statistics.median(values), min(values), max(values)) if values else None


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial sign test of ``wins`` against ``losses`` (ties already dropped): the
    probability, under p = 1/2, of a split at least as uneven. 1.0 with no untied pairs."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / math.pow(2, n)
    return min(1.0, 2 * tail)


def worst(runs: Sequence[Run]) -> Run | None:
    """The run with the most charged steps (ties: the longer wall time)."""
    return max(runs, key=lambda r: (charged_steps(r), charged_wall(r)), default=None)


def compare(ours: Sequence[Run], theirs: Sequence[Run]) -> Comparison | None:
    """:class:`Comparison` over the seeds both lists ran (None if they share none)."""
    mine, other = {r["seed"]: r for r in ours}, {r["seed"]: r for r in theirs}
    both = sorted(set(mine) & set(other))
    if not both:
        return None
    diffs = [charged_steps(mine[s]) - charged_steps(other[s]) for s in both]
    fewer, more = sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)

    def ratio(charge: Callable[[Run], float]) -> float:
        top = statistics.median(charge(mine[s]) for s in both)
        return float(top / statistics.median(charge(other[s]) for s in both))

    return Comparison(len(both), fewer, more, len(both) - fewer - more, sign_test(fewer, more),
                      ratio(charged_steps), ratio(charged_wall))


def goals(by: dict[str, list[Run]], name: str = "popmesh") -> list[tuple[str, str, bool]]:
    """The comparison's goals for popmesh contender ``name``, each as (goal, its figures, whether it holds),
    for the contenders present: median steps at most STEP_GOAL of each step rival's, median wall time at
    most WALL_GOAL of Ray's, and its worst seed no worse (in steps) than the worst without a policy."""
    ours = by.get(name, [])
    if not ours:
        return []
    out = []
    steps = statistics.median(charged_steps(r) for r in ours)
    wall = statistics.median(charged_wall(r) for r in ours)
    for rival in (r for r in STEP_RIVALS if by.get(r)):
        theirs = statistics.median(charged_steps(r) for r in by[rival])
        out.append((f"median steps ≥ {1 - STEP_GOAL:.0%} fewer than {rival}",
                    f"{steps:,.0f} against {theirs:,.0f} ({steps / theirs:.2f}x)", steps <= STEP_GOAL * theirs))
    for rival in (r for r in WALL_RIVALS if by.get(r)):
        theirs = statistics.median(charged_wall(r) for r in by[rival])
        out.append((f"median wall ≤ {WALL_GOAL}x {rival}'s", f"{wall:.1f} s against {theirs:.1f} s "
                    f"({wall / theirs:.2f}x)", wall <= WALL_GOAL * theirs))
    if by.get("none"):
        a, b = max(charged_steps(r) for r in ours), max(charged_steps(r) for r in by["none"])
        out.append(("worst seed no worse than none's", f"{a:,} against {b:,} steps", a <= b))
    return out


# ---- the tables (markdown) ----

def spread(values: Sequence[float | None], unit: str = "") -> str:
    """``median (min–max)`` of the known values (the range left out when all are equal): steps with
    thousands separators, else one decimal, the median followed by ``unit``; ``—`` when none is known."""
    known = [v for v in values if v is not None]
    found = median_range(known)
    if found is None:
        return "—"
    def fmt(v: float) -> str:
        return f"{v:,.0f}" if unit == "" else f"{v:.1f}"

    mid, low, high = found
    return f"{fmt(mid)}{unit}" + (f" ({fmt(low)}–{fmt(high)})" if low != high else "")


def by_contender(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs per contender, in :data:`CONTENDERS`' order (others after), each sorted by seed."""
    names = [n for n in CONTENDERS if any(r["contender"] == n for r in runs)]
    names += sorted({r["contender"] for r in runs} - set(names))
    return {n: sorted((r for r in runs if r["contender"] == n), key=lambda r: r["seed"]) for n in names}


def task_heading(runs: Sequence[Run]) -> str:
    """What one task's runs trained on: env, target, initial ranges, budget, agents, seeds."""
    first = runs[0]
    budgets = ", ".join(f"{b:,}" for b in sorted({r["budget"] for r in runs}))
    seeds = sorted({r["seed"] for r in runs})
    if "l1_target" in first:
        return grid_heading(first, budgets, seeds)
    (lr_low, lr_high), (ent_low, ent_high) = first["lr_range"], first["ent_range"]
    return (f"### {first['task']}: {first['env']}, target {first['target']:g} (an agent's mean return over its "
            f"last 20 episodes)\n\nInitial learning rate log-uniform over {lr_low:g}–{lr_high:g}, entropy "
            f"coefficient over {ent_low:g}–{ent_high:g}, drawn per rank and seed (the same for every contender); "
            f"{first['ranks']} agents; budget {budgets} env steps per agent; seeds {', '.join(map(str, seeds))}.")


def grid_heading(first: Run, budgets: str, seeds: list[int]) -> str:
    """The hypergrid task's heading: its grid, target, learning rates, budget, agents, seeds, and what the
    contenders run there."""
    lr_low, lr_high = first["lr_range"]
    return (f"### {first['task']}: {first['env']}, target: an agent's exact L1 to the target distribution at most "
            f"{first['l1_target']:g} at a validation (every {first['every']} iterations)\n\nSteps: trajectories "
            f"sampled by that agent ({first['batch']} per iteration). Initial learning rate log-uniform over "
            f"{lr_low:g}–{lr_high:g}, drawn per rank and seed (the same for every contender), the only value "
            f"explored; {first['ranks']} agents; budget {budgets} trajectories per agent; seeds "
            f"{', '.join(map(str, seeds))}. popmesh's contenders run examples/gfn_hypergrid.py --buffers 0 "
            "(`--policy selective --decide latest|complete`, ranking by -L1, or `--policy none`; "
            "`--share-trajectories` for the shared contenders); Ray's, the same "
            "agent (benchmarks/_ray_gfn.py), ranked by -L1.")


def l1_table(by: dict[str, list[Run]]) -> str:
    """Per contender, median (range) over the seeds of the final L1 (population mean and worst agent) and
    of the population mean over every validation; and per seed the final population mean."""
    seeds = sorted({r["seed"] for runs in by.values() for r in runs})
    lines = ["| contender | final L1, population mean | final L1, worst agent | mean L1 over validations | "
             + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|---|---|---|" + "---|" * len(seeds)]
    for name, runs in by.items():
        at = {r["seed"]: r for r in runs}
        per_seed = [f"{at[s]['final_mean_l1']:.3f}" if s in at else "—" for s in seeds]
        lines.append(f"| {name} | {l1_spread([r['final_mean_l1'] for r in runs])} | "
                     f"{l1_spread([r['final_worst_l1'] for r in runs])} | "
                     f"{l1_spread([r['mean_mean_l1'] for r in runs])} | " + " | ".join(per_seed) + " |")
    return "\n".join(lines)


def l1_spread(values: Sequence[float]) -> str:
    """``median (min–max)`` to three decimals; ``—`` for none."""
    found = median_range(values)
    if found is None:
        return "—"
    mid, low, high = found
    return f"{mid:.3f}" + (f" ({low:.3f}–{high:.3f})" if low != high else "")


def summary_table(by: dict[str, list[Run]]) -> str:
    """Per contender: median (range) of steps and wall time to the target, the worst seed, the misses."""
    lines = ["| contender | runs | steps to target (agent) | wall time to target | worst seed | never reached |",
             "|---|---|---|---|---|---|"]
    for name, runs in by.items():
        bad = worst(runs)
        assert bad is not None  # by_contender lists contenders with runs only
        missed = [r for r in runs if r["steps"] is None]
        lines.append(f"| {name} | {len(runs)} | {spread([charged_steps(r) for r in runs])} | "
                     f"{spread([charged_wall(r) for r in runs], ' s')} | seed {bad['seed']}: "
                     f"{charged_steps(bad):,} steps, {charged_wall(bad):.1f} s | {len(missed)} of {len(runs)} |")
    return "\n".join(lines)


def costs_table(by: dict[str, list[Run]]) -> str:
    """Per contender, median (range) of what a run cost besides its steps (over the runs that have it)."""
    lines = ["| contender | population steps | wall without start-up | start-up | exploits | overhead per exploit "
             "| per iteration |", "|---|---|---|---|---|---|---|"]
    for name, runs in by.items():
        of = {key: [r.get(key) for r in runs] for key in ("population_steps", "train_s", "startup_s", "exploits",
                                                          "overhead_ms", "iteration_ms")}
        lines.append(f"| {name} | {spread(of['population_steps'])} | {spread(of['train_s'], ' s')} | "
                     f"{spread(of['startup_s'], ' s')} | {spread(of['exploits'])} | "
                     f"{spread(of['overhead_ms'], ' ms')} | {spread(of['iteration_ms'], ' ms')} |")
    return "\n".join(lines)


def per_seed_table(by: dict[str, list[Run]]) -> str:
    """One column per seed; per contender a row of steps to the target (``*``: that agent had been
    replaced before; ``†``: never reached, the budget) and a row of wall time (``†``: the whole run)."""
    seeds = sorted({r["seed"] for runs in by.values() for r in runs})
    lines = ["| | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name, runs in by.items():
        at = {r["seed"]: r for r in runs}
        steps, wall = [], []
        for seed in seeds:
            run = at.get(seed)
            mark = "" if run is None or run["steps"] is not None else "†"
            star = "*" if run is not None and run.get("was_replaced") else ""
            steps.append("—" if run is None else f"{charged_steps(run):,}{star}{mark}")
            wall.append("—" if run is None else f"{charged_wall(run):.1f} s{mark}")
        lines += [f"| {name} steps | " + " | ".join(steps) + " |", f"| {name} wall | " + " | ".join(wall) + " |"]
    return "\n".join(lines)


def comparison_table(by: dict[str, list[Run]], ours: str = "popmesh") -> str:
    """Popmesh contender ``ours`` against every other contender, seed by seed (:func:`compare`)."""
    lines = [f"| {ours} against | seeds | {ours} fewer steps | more | equal | sign test p (two-sided) | "
             f"median steps, {ours} / other | median wall, {ours} / other |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in by.items():
        c = compare(by.get(ours, []), runs) if name != ours else None
        if c is not None:
            lines.append(f"| {name} | {c.seeds} | {c.fewer} | {c.more} | {c.equal} | {c.p:.3g} | "
                         f"{c.steps_ratio:.2f}x | {c.wall_ratio:.2f}x |")
    return "\n".join(lines) if len(lines) > 2 else ""


def goals_table(by: dict[str, list[Run]], name: str = "popmesh") -> str:
    """The goals (:func:`goals`) of popmesh contender ``name`` with their figures and whether each holds."""
    rows = goals(by, name)
    lines = [f"| goal for {name} | figures | holds |", "|---|---|---|"]
    lines += [f"| {goal} | {figures} | {'yes' if holds else 'no'} |" for goal, figures, holds in rows]
    return "\n".join(lines) if rows else ""


def start_mismatches(runs: Sequence[Run]) -> list[int]:
    """The seeds whose contenders did not all start from the same per-rank hyper-parameters (the
    ``initial`` [lr, ent_coef] per rank each run records; runs without it are not judged)."""
    seeds = sorted({r["seed"] for r in runs})
    starts = {s: {tuple(map(tuple, r["initial"])) for r in runs if r["seed"] == s and r.get("initial")} for s in seeds}
    return [s for s in seeds if len(starts[s]) > 1]


NOTES = ("Steps: the env steps (hypergrid: trajectories) of the agent that reached the target first (its own, "
         "not the population's); wall: seconds from the run's process start. A run that never reached the target "
         "(†) counts as the budget: its steps as the step cap per agent, its wall time as the whole run's; medians, "
         "ranges, worst seeds, sign tests and goals all use these. *: that agent had been replaced by the population "
         "before.")


def task_report(runs: Sequence[Run]) -> str:
    """One task's tables: summary, costs, per seed, popmesh against each other contender, goals."""
    by = by_contender(runs)
    parts = [task_heading(runs), summary_table(by), costs_table(by), per_seed_table(by), NOTES]
    if all("final_mean_l1" in r for r in runs):
        parts.insert(2, l1_table(by))
    mismatched = start_mismatches(runs)
    if mismatched:
        parts.append(f"**Warning**: seeds {mismatched} did not start every contender from the same "
                     "hyper-parameters; their comparison is not like for like.")
    for ours in OURS:  # each popmesh contender that ran, against the others
        parts += [t for t in (comparison_table(by, ours), goals_table(by, ours)) if t]
    return "\n\n".join(parts)


def latest(runs: Sequence[Run]) -> tuple[list[Run], int]:
    """One run per (task, contender, seed), the later where logs hold several; and how many were dropped."""
    kept = {(r["task"], r["contender"], r["seed"]): r for r in runs}
    return list(kept.values()), len(runs) - len(kept)


def report(runs: Sequence[Run]) -> str:
    """Every task's tables, after a line per contender present saying what it runs."""
    runs, dropped = latest(runs)
    present = by_contender(runs)
    intro = ["popmesh trains a population of agents (PPO on the demo's tasks, GFlowNets on the hypergrid), one per "
             "rank, and lets a population policy replace weak agents by averages of strong ones while all train. "
             "Contenders:", ""]
    intro += [f"* **{name}**: {CONTENDERS.get(name, '')}" for name in present]
    if dropped:
        intro += ["", f"{dropped} run(s) repeat a task, contender and seed listed later: the later run is used."]
    tasks = sorted({r["task"] for r in runs}, key=lambda t: min(i for i, r in enumerate(runs) if r["task"] == t))
    return "\n".join(intro) + "\n\n" + "\n\n".join(task_report([r for r in runs if r["task"] == t]) for t in tasks)
