"""popmesh's population policy against Ray Tune's PBT and PB2 (and no policy at all), on the demo's PPO
agents: the same agent code, 4 agents at once on the same cores, the same budget, seed by seed.

Tasks (`--task`, several allowed), each the demo's `--env` with its target (an agent's mean return over
its last 20 episodes) and the initial ranges each rank draws its learning rate and entropy
coefficient from, log-uniformly, seeded per rank and seed (`popmesh.demo.config.rank_hyper`):

* `cartpole`: CartPole-v1, target 475; narrow ranges: lr 2e-4..6e-3, ent_coef 1e-3..2e-2
* `cartpole-wide`: CartPole-v1, target 475; the demo's ranges: lr 1e-5..1e-1, ent_coef 1e-4..1e-1
* `acrobot`, `acrobot-wide`: the same for Acrobot-v1, target -100

Contenders (`--contenders`, default all), run one after another for each seed (odd seeds in reverse
order), each in its own process, timed from its start:

* `popmesh`: `popmesh demo --stop-at-target --decide latest` (its default asynchronous policy: each
  agent judged the moment it reports, against every member's latest report; a bottom-quarter agent that
  trails by both gaps takes the mean of the two best, its lr and ent_coef explored);
* `popmesh-complete`: the same with `--decide complete` (decides once every agent reported an iteration);
* `none`: `popmesh demo --policy none`, the same agents without a population policy;
* `ray-pbt`: Ray Tune `PopulationBasedTraining` around the same learner (benchmarks/_ray_pbt.py): 4
  concurrent trials (`ray.init(num_cpus=4)`, one CPU each, `reuse_actors=True`), asynchronous,
  `perturbation_interval` and `burn_in_period` the demo's `--every` and `--warmup` (iterations),
  `quantile_fraction=0.25`, lr and ent_coef perturbed ×0.8/×1.2 or resampled log-uniformly over the
  task's ranges with p = 0.25, clipped to them (the demo's explore step);
* `ray-pb2`: Ray Tune `PB2`, the same, its GP bandit choosing the new values within
  `hyperparam_bounds` equal to the task's ranges on a log scale.

Every contender of a task starts rank r from the same hyper-parameters, seeds (`rank_seed`) and
initial weights (`init_seed`: the seed), with the same budget (steps per agent), one torch thread per
agent and 512 env steps per iteration. Per run: steps to the target (that agent's own, and the
population's summed), wall time to the target from the process start and from the end of the first
iteration (without start-up), exploits, and the overhead per exploit (popmesh: main-thread time in the
policy calls of every rank, from trace.json, per replacement; Ray: checkpoint saves of every trial plus
each exploited trial's interruption, from its last report to training again, per exploit). A run that
never reaches the target counts as the budget in the tables (benchmarks/_pbt_tables.py).

Ray is needed for the Ray contenders only: `pip install -e '.[demo,bench,pb2]'` (the `bench` extra is
`ray[tune]>=2.60.0`, tested with Ray 2.60.0; Ray's PB2 also needs scikit-learn, the `pb2` extra), then,
e.g. one seed per call:

    python benchmarks/population_vs_pbt.py --task cartpole --first-seed 0 --seeds 1 | tee -a cartpole.log
    python benchmarks/population_vs_pbt.py --task acrobot-wide --seeds 5 --steps 150000
    python benchmarks/population_vs_pbt.py --results cartpole.log acrobot.log
    python benchmarks/population_vs_pbt.py --task cartpole-wide --quick
    python benchmarks/population_vs_pbt.py --contenders popmesh ray-pbt -- --strategy best_only

Each run prints one JSON line as it ends and the tables at the end; `--results LOG...` prints the
tables of earlier calls' JSON lines. `--quick` checks the plumbing: one seed, 20,000 steps. Options
after `--` go to every popmesh contender's `popmesh demo` call.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _pbt_tables import CONTENDERS, report
from _ray_pbt import RaySetup, overhead, read_jsonl, significant, spawn
from popmesh.demo.config import ENT_RANGE, ENVS, LR_RANGE, DemoConfig
from popmesh.demo.learner import Hyper
from popmesh.demo.outputs import steps_to_target

Run = dict[str, Any]
NARROW_LR, NARROW_ENT = (2e-4, 6e-3), (1e-3, 2e-2)
DEMO_FLAGS = {"popmesh": ["--decide", "latest"], "popmesh-complete": ["--decide", "complete"],
              "none": ["--policy", "none"]}
RAY_SCHEDULERS = {"ray-pbt": "pbt", "ray-pb2": "pb2"}
PER_ITERATION = Hyper().rollout * Hyper().num_envs  # env steps per agent per iteration (512), both sides


@dataclass(frozen=True)
class Task:
    """A demo task with the initial ranges of its learning rate and entropy coefficient."""

    name: str
    env: str
    lr_range: tuple[float, float]
    ent_range: tuple[float, float]

    @property
    def target(self) -> float:
        return ENVS[self.env]


TASKS = {t.name: t for t in (Task("cartpole", "CartPole-v1", NARROW_LR, NARROW_ENT),
                             Task("cartpole-wide", "CartPole-v1", LR_RANGE, ENT_RANGE),
                             Task("acrobot", "Acrobot-v1", NARROW_LR, NARROW_ENT),
                             Task("acrobot-wide", "Acrobot-v1", LR_RANGE, ENT_RANGE))}


@dataclass(frozen=True)
class Plan:
    """What every contender of one task and seed shares."""

    task: Task
    seed: int
    budget: int  # env steps per agent
    every: int
    warmup: int
    ranks: int = 4
    demo_args: tuple[str, ...] = ()

    def fields(self) -> Run:
        """The run's settings as its JSON line keeps them; the budget as the agents take it, in whole
        iterations (an agent stops at the first iteration that reaches it)."""
        t = self.task
        return {"task": t.name, "seed": self.seed, "env": t.env, "target": t.target, "lr_range": list(t.lr_range),
                "ent_range": list(t.ent_range), "budget": -(-self.budget // PER_ITERATION) * PER_ITERATION,
                "ranks": self.ranks, "every": self.every, "warmup": self.warmup}


def run_popmesh(name: str, plan: Plan, tmp: Path) -> Run:
    """One `popmesh demo` run of contender ``name``; its figures from summary.json, history.jsonl,
    events.jsonl and trace.json."""
    t = plan.task
    cmd = [sys.executable, "-m", "popmesh", "demo", "--env", t.env, "--lr-range", ":".join(map(str, t.lr_range)),
           "--ent-range", ":".join(map(str, t.ent_range)), "--every", str(plan.every), "--warmup", str(plan.warmup),
           "--seed", str(plan.seed), "--steps", str(plan.budget), "--ranks", str(plan.ranks), "--stop-at-target",
           "--no-live", "--out", str(tmp), *DEMO_FLAGS[name], *plan.demo_args]
    started = time.time()
    done = subprocess.run(cmd, timeout=1800, capture_output=True, text=True)
    total = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    run = next(tmp.glob("*/summary.json")).parent
    summary = json.loads((run / "summary.json").read_text())
    rows = read_jsonl(run / "history.jsonl")
    trace = json.loads((run / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    policy_s = sum(e["dur"] for e in events if e.get("name") == "population" and e.get("cat") == "timer") / 1e6
    replaced = summary["replacements"]
    swaps = [e for e in read_jsonl(run / "events.jsonl") if "kind" not in e]
    return {"contender": name, **plan.fields(), **reach(rows, started, swaps, t.target), "total_s": round(total, 2),
            "exploits": replaced, "overhead_ms": round(1e3 * policy_s / replaced, 2) if replaced else None,
            "initial": initial(rows), "demo_args": list(plan.demo_args)}


def run_ray(name: str, plan: Plan, tmp: Path) -> Run:
    """One Ray Tune run of contender ``name`` (benchmarks/_ray_pbt.py, its own process)."""
    t = plan.task
    setup = RaySetup(scheduler=RAY_SCHEDULERS[name], env=t.env, target=t.target, seed=plan.seed, steps=plan.budget,
                     every=plan.every, warmup=plan.warmup, lr_range=t.lr_range, ent_range=t.ent_range,
                     ranks=plan.ranks, out=str(tmp))
    records, started, total = spawn(setup)
    rows = [r for r in records if r["kind"] == "row"]
    starts = [r for r in records if r["kind"] == "start"]
    ranks = {r["trial"]: r["rank"] for r in starts}
    swaps = [{"rank": ranks[r["trial"]], "time": r["time"]} for r in records if r["kind"] == "restore"]
    return {"contender": name, **plan.fields(), **reach(rows, started, swaps, t.target), "total_s": round(total, 2),
            **overhead(records), "initial": [[r["lr"], r["ent_coef"]] for r in sorted(starts, key=lambda r: r["rank"])]}


def reach(rows: list[Run], started: float, swaps: list[Run], target: float) -> Run:
    """The target in a history (rows with rank, steps, mean_return, time): the first row at or above it
    (its agent's steps and rank, and whether ``swaps``, exploits with rank and time, had replaced that
    agent before), the population's steps then, and the times from ``started``."""
    rows = sorted(rows, key=lambda r: r["time"])
    first = rows[0]["time"]
    hit = next((r for r in rows if r["mean_return"] is not None and r["mean_return"] >= target), None)
    out: Run = {"startup_s": round(first - started, 2), "iteration_ms": iteration_ms(rows), "steps": None,
                "population_steps": None, "wall_s": None, "train_s": None}
    if hit is not None:
        out.update(steps=hit["steps"], population_steps=steps_to_target(rows, target), rank=hit["rank"],
                   was_replaced=any(e["rank"] == hit["rank"] and e["time"] < hit["time"] for e in swaps),
                   wall_s=round(hit["time"] - started, 2), train_s=round(hit["time"] - first, 2))
    return out


def iteration_ms(rows: list[Run]) -> float:
    """The median time between an agent's consecutive rows (one iteration, and whatever it waited)."""
    laps: list[float] = []
    for rank in {r["rank"] for r in rows}:
        times = [r["time"] for r in rows if r["rank"] == rank]
        laps += [b - a for a, b in itertools.pairwise(times)]
    return round(1e3 * statistics.median(laps), 1)


def initial(rows: list[Run]) -> list[list[float]]:
    """Each rank's [lr, ent_coef] in its first history row (before any decision: its starting values)."""
    firsts = {r["rank"]: r for r in sorted(rows, key=lambda r: r["time"], reverse=True)}
    return [list(significant({"lr": r["lr"], "ent_coef": r["ent_coef"]}).values())
            for _, r in sorted(firsts.items())]


def run_one(name: str, plan: Plan) -> Run:
    """Contender ``name`` on ``plan``, in a temporary folder."""
    runner = run_ray if name in RAY_SCHEDULERS else run_popmesh
    with tempfile.TemporaryDirectory(prefix="pbt-") as tmp:
        return runner(name, plan, Path(tmp))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--task", nargs="+", choices=tuple(TASKS), default=["cartpole"],
                        help="the tasks, one after another (default cartpole)")
    parser.add_argument("--contenders", nargs="+", choices=tuple(CONTENDERS), default=list(CONTENDERS),
                        help="who runs (default all)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per task (default 5)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150_000,
                        help="budget: env steps per agent, rounded up to whole iterations of 512 (default 150,000)")
    parser.add_argument("--every", type=int, default=defaults.every,
                        help=f"iterations between decisions, every contender (default the demo's, {defaults.every})")
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help=f"iterations before the first decision (default the demo's, {defaults.warmup})")
    parser.add_argument("--quick", action="store_true", help="one seed, 20,000 steps: checks the plumbing")
    parser.add_argument("--results", type=Path, nargs="+", metavar="LOG",
                        help="run nothing: the tables of the runs these logs of earlier calls hold (their JSON lines)")
    parser.add_argument("demo_args", nargs="*", help="popmesh demo options after --, e.g. -- --strategy best_only")
    return parser.parse_args(argv)


def missing(names: list[str]) -> list[str]:
    """What the chosen contenders need and this environment lacks, as the extras that bring it."""
    needs = {"ray": ("ray-pbt", "ray-pb2"), "sklearn": ("ray-pb2",)}
    extras = {"ray": "bench (ray[tune])", "sklearn": "pb2 (scikit-learn, for Ray's PB2)"}
    return [extras[m] for m, users in needs.items() if set(users) & set(names) and importlib.util.find_spec(m) is None]


def main() -> None:
    ns = parse()
    if ns.results:
        print(report([r for log in ns.results for r in read_jsonl(log) if "contender" in r and "task" in r]))
        return
    lacking = missing(ns.contenders)
    if lacking:
        sys.exit(f"missing: {'; '.join(lacking)}. Install the extras: pip install -e '.[demo,bench,pb2]', or leave "
                 "the Ray contenders out (--contenders popmesh popmesh-complete none)")
    seeds, budget = (1, 20_000) if ns.quick else (ns.seeds, ns.steps)
    names = [n for n in CONTENDERS if n in ns.contenders]
    runs = []
    for task in ns.task:
        for seed in range(ns.first_seed, ns.first_seed + seeds):
            plan = Plan(TASKS[task], seed, budget, ns.every, ns.warmup, demo_args=tuple(ns.demo_args))
            for name in names if seed % 2 == 0 else names[::-1]:  # by the seed: one seed per call alternates too
                runs.append(run_one(name, plan))
                print(json.dumps(runs[-1]), flush=True)
    print("\n" + report(runs))


if __name__ == "__main__":
    main()
