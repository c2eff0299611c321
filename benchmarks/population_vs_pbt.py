"""popmesh's population policy against Ray Tune's PBT and PB2 (and no policy at all), on the demo's PPO
agents and on the GFlowNets of examples/gfn_hypergrid.py: the same agent code, 4 agents at once on the
same cores, the same budget, seed by seed.

Tasks (`--task`, several allowed). The PPO tasks are the demo's `--env` with its target (an agent's mean
return over its last 20 episodes) and the initial ranges each rank draws its learning rate and entropy
coefficient from, log-uniformly, seeded per rank and seed (`popmesh.demo.config.rank_hyper`):

* `cartpole`: CartPole-v1, target 475; narrow ranges: lr 2e-4..6e-3, ent_coef 1e-3..2e-2
* `cartpole-wide`: CartPole-v1, target 475; the demo's ranges: lr 1e-5..1e-1, ent_coef 1e-4..1e-1
* `acrobot`, `acrobot-wide`: the same for Acrobot-v1, target -100
* `hypergrid`: examples/gfn_hypergrid.py's trajectory-balance GFlowNets on the 2-D hypergrid of height 16,
  R0 = 0.01 (four modes apart in low reward), 16 trajectories per iteration, each rank's learning rate
  log-uniform over 1e-5..1e-1 per seed and rank (`hypergrid_agent.start_lr`), the only value explored.
  Target: an agent's exact L1 distance to the target distribution at or below 0.1 at a validation
  (every 25 iterations); steps: the trajectories that agent sampled; budget 800 iterations (12,800
  trajectories). Why: in trial runs without a policy (seeds 0-2, 1,000 iterations) the best agent's
  L1 reached 0.3 in every seed (iterations 250-875), 0.1 in seeds 0 and 1 (iterations 475 and 900, at
  learning rates 3.5e-3 and 1.1e-3; 1e-5..1e-4 barely leave the start, 2e-2 and above stall between
  0.3 and 1.0), 0.05 in none. In 800 iterations no policy reaches 0.1 in most seeds while a good
  learning rate does: a lower target leaves every contender at the budget, a higher one is reached by
  the best initial agent alone. The tables add the final population-mean and worst agent's L1.

Contenders (`--contenders`, default all), run one after another for each seed (odd seeds in reverse
order), each in its own process, timed from its start. On the PPO tasks:

* `popmesh`: `popmesh demo --stop-at-target --decide latest` (its default asynchronous policy: each
  agent judged the moment it reports, against every member's latest report; an agent in the bottom half
  that trails the best by both gaps takes the best agent's weights, its lr and ent_coef explored);
* `popmesh-shared`: the same with `--share-samples` (each agent also trains on the others' rollouts,
  with decoupled PPO and V-trace: popmesh.population.SampleSharing);
* `popmesh-complete`: the same with `--decide complete` (decides once every agent reported an iteration);
* `none`: `popmesh demo --policy none`, the same agents without a population policy;
* `shared-none`: `popmesh demo --policy none --share-samples`, the agents sharing rollouts, no policy;
* `ray-pbt`: Ray Tune `PopulationBasedTraining` around the same learner (benchmarks/_ray_pbt.py): 4
  concurrent trials (`ray.init(num_cpus=4)`, one CPU each, `reuse_actors=True`), asynchronous,
  `perturbation_interval` and `burn_in_period` the demo's `--every` and `--warmup` (iterations),
  `quantile_fraction=0.25`, lr and ent_coef perturbed ×0.8/×1.2 or resampled log-uniformly over the
  task's ranges with p = 0.25, clipped to them (the demo's explore step);
* `ray-pb2`: Ray Tune `PB2`, the same, its GP bandit choosing the new values within
  `hyperparam_bounds` equal to the task's ranges on a log scale.

On the hypergrid the popmesh contenders launch examples/gfn_hypergrid.py on 4 ranks with `--buffers 0`
(every rank trains; the replay-buffer service, which only counts the modes sampled, is left out since
the Ray trials cannot have it: the agents train on fresh trajectories either way): `popmesh` with
`--policy selective --decide latest` (ranked by -L1, a replaced agent takes the mean of the two best
and its best donor's learning rate, explored), `popmesh-shared` the same with `--share-trajectories`
(each trainer also trains on the others' trajectories), `popmesh-complete` with `--decide complete`,
`none` with `--policy none`, `shared-none` with `--policy none --share-trajectories`; `ray-pbt` and
`ray-pb2` run the same agent (`hypergrid_agent.Agent`) as a function trainable (benchmarks/_ray_gfn.py),
ranked by -L1, `perturbation_interval` 25 (the decision cadence), `burn_in_period` 0 (the example's
policy has none), `quantile_fraction=0.25`, the learning rate explored as above over 1e-5..1e-1.
Every contender validates every 25 iterations and runs the whole budget (the final L1 needs it).

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
    python benchmarks/population_vs_pbt.py --task hypergrid --first-seed 0 --seeds 1 | tee -a hypergrid.log
    python benchmarks/population_vs_pbt.py --contenders popmesh ray-pbt -- --strategy best_only

Each run prints one JSON line as it ends and the tables at the end; `--results LOG...` prints the
tables of earlier calls' JSON lines. `--quick` checks the plumbing: one seed, 20,000 steps (hypergrid:
200 iterations). Options after `--` go to every popmesh contender's `popmesh demo` call (hypergrid: its
examples/gfn_hypergrid.py launch). The hypergrid needs torchgfn (`pip install --no-deps torchgfn==2.4.1`).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gfn_population
from _pbt_tables import CONTENDERS, report
from _ray_gfn import GridSetup
from _ray_gfn import run as run_ray_grid
from _ray_pbt import RaySetup, overhead, read_jsonl, significant, spawn
from popmesh.demo.config import ENT_RANGE, ENVS, LR_RANGE, DemoConfig
from popmesh.demo.learner import Hyper

Run = dict[str, Any]
Hit = Callable[[Run], bool]  # whether a history row is at the target
NARROW_LR, NARROW_ENT = (2e-4, 6e-3), (1e-3, 2e-2)
DEMO_FLAGS = {"popmesh": ["--decide", "latest"], "popmesh-shared": ["--decide", "latest", "--share-samples"],
              "popmesh-complete": ["--decide", "complete"], "none": ["--policy", "none"],
              "shared-none": ["--policy", "none", "--share-samples"]}
RAY_SCHEDULERS = {"ray-pbt": "pbt", "ray-pb2": "pb2"}
PER_ITERATION = Hyper().rollout * Hyper().num_envs  # env steps per agent per iteration (512), both sides


@dataclass(frozen=True)
class Task:
    """A demo task with the initial ranges of its learning rate and entropy coefficient."""

    name: str
    env: str
    lr_range: tuple[float, float]
    ent_range: tuple[float, float]

    budget: int = 150_000  # env steps per agent
    quick: int = 20_000
    every: int = DemoConfig().every
    warmup: int = DemoConfig().warmup
    per_iteration: int = PER_ITERATION

    @property
    def target(self) -> float:
        return ENVS[self.env]

    def fields(self, plan: Plan) -> Run:
        return {"env": self.env, "target": self.target, "lr_range": list(self.lr_range),
                "ent_range": list(self.ent_range)}

    def run(self, name: str, plan: Plan, tmp: Path) -> Run:
        return (run_ray if name in RAY_SCHEDULERS else run_popmesh)(name, plan, tmp)


@dataclass(frozen=True)
class GridTask:
    """The GFlowNet hypergrid of examples/gfn_hypergrid.py; the target: an agent's exact L1 at or below
    ``l1_target`` at a validation; steps: the trajectories that agent sampled."""

    name: str = "hypergrid"
    ndim: int = 2
    height: int = 16
    r0: float = 0.01
    lr_range: tuple[float, float] = (1e-5, 1e-1)
    l1_target: float = 0.1
    per_iteration: int = 16  # trajectories per agent and iteration
    budget: int = 800 * 16  # trajectories per agent: 800 iterations
    quick: int = 200 * 16
    every: int = 25  # iterations between decisions and validations, every contender
    warmup: int = 0  # the example's policy has no burn-in

    def fields(self, plan: Plan) -> Run:
        return {"env": f"hypergrid {self.ndim}-D, height {self.height}, R0 {self.r0:g}", "l1_target": self.l1_target,
                "lr_range": list(self.lr_range), "batch": self.per_iteration}

    def run(self, name: str, plan: Plan, tmp: Path) -> Run:
        return (run_ray_gfn if name in RAY_SCHEDULERS else run_popmesh_gfn)(name, plan, tmp)


TASKS: dict[str, Task | GridTask] = {
    t.name: t for t in (Task("cartpole", "CartPole-v1", NARROW_LR, NARROW_ENT),
                        Task("cartpole-wide", "CartPole-v1", LR_RANGE, ENT_RANGE),
                        Task("acrobot", "Acrobot-v1", NARROW_LR, NARROW_ENT),
                        Task("acrobot-wide", "Acrobot-v1", LR_RANGE, ENT_RANGE), GridTask())}
GFN_FLAGS = {"popmesh": ["--policy", "selective", "--decide", "latest"],
             "popmesh-shared": ["--policy", "selective", "--decide", "latest", "--share-trajectories"],
             "popmesh-complete": ["--policy", "selective", "--decide", "complete"], "none": ["--policy", "none"],
             "shared-none": ["--policy", "none", "--share-trajectories"]}


@dataclass(frozen=True)
class Plan:
    """What every contender of one task and seed shares."""

    task: Task | GridTask
    seed: int
    budget: int  # env steps (hypergrid: trajectories) per agent
    every: int
    warmup: int
    ranks: int = 4
    demo_args: tuple[str, ...] = ()

    @property
    def iterations(self) -> int:
        """The budget in whole iterations (an agent stops at the first iteration that reaches it)."""
        return -(-self.budget // self.task.per_iteration)

    def fields(self) -> Run:
        """The run's settings as its JSON line keeps them; the budget as the agents take it."""
        return {"task": self.task.name, "seed": self.seed, **self.task.fields(self),
                "budget": self.iterations * self.task.per_iteration, "ranks": self.ranks, "every": self.every,
                "warmup": self.warmup}


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
    return {"contender": name, **plan.fields(), **reach(rows, started, swaps, returns_at_least(t.target)),
            "total_s": round(total, 2), "exploits": replaced,
            "overhead_ms": round(1e3 * policy_s / replaced, 2) if replaced else None, "initial": initial(rows),
            "demo_args": list(plan.demo_args)}


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
    return {"contender": name, **plan.fields(), **reach(rows, started, swaps, returns_at_least(t.target)),
            "total_s": round(total, 2), **overhead(records),
            "initial": [[r["lr"], r["ent_coef"]] for r in sorted(starts, key=lambda r: r["rank"])]}


def returns_at_least(target: float) -> Hit:
    """The PPO tasks' target: a row whose mean return (last 20 episodes) is at least ``target``."""
    return lambda row: row["mean_return"] is not None and row["mean_return"] >= target


def l1_at_most(target: float) -> Hit:
    """The hypergrid's target: a validation row whose exact L1 is at most ``target``."""
    return lambda row: row["l1"] <= target


def reach(rows: list[Run], started: float, swaps: list[Run], hit: Hit, per_row: int = 1) -> Run:
    """The target in a history (rows with rank, steps, time and what ``hit`` reads; ``per_row``
    iterations apart): the first row at it (its agent's steps and rank, and whether ``swaps``, exploits
    with rank and time, had replaced that agent before), the population's steps then, and the times
    from ``started``."""
    rows = sorted(rows, key=lambda r: r["time"])
    first = rows[0]["time"]
    at = next((r for r in rows if hit(r)), None)
    out: Run = {"startup_s": round(first - started, 2), "iteration_ms": iteration_ms(rows, per_row), "steps": None,
                "population_steps": None, "wall_s": None, "train_s": None}
    if at is not None:
        out.update(steps=at["steps"], population_steps=population_steps(rows, hit), rank=at["rank"],
                   was_replaced=any(e["rank"] == at["rank"] and e["time"] < at["time"] for e in swaps),
                   wall_s=round(at["time"] - started, 2), train_s=round(at["time"] - first, 2))
    return out


def population_steps(rows: list[Run], hit: Hit) -> int | None:
    """The population's steps (every agent's latest, summed) at the first row in time at the target."""
    latest: dict[int, int] = {}
    for row in sorted(rows, key=lambda r: r["time"]):
        latest[row["rank"]] = row["steps"]
        if hit(row):
            return sum(latest.values())
    return None


def iteration_ms(rows: list[Run], per_row: int = 1) -> float:
    """The median time between an agent's consecutive rows, per iteration (rows ``per_row`` iterations
    apart): one iteration, and whatever it waited."""
    laps: list[float] = []
    for rank in {r["rank"] for r in rows}:
        times = [r["time"] for r in rows if r["rank"] == rank]
        laps += [b - a for a, b in itertools.pairwise(times)]
    return round(1e3 * statistics.median(laps) / per_row, 1)


def with_steps(rows: list[Run], per_iteration: int) -> list[Run]:
    """The example's history rows with ``steps``: the trajectories the agent sampled up to that row."""
    return [{**r, "steps": (r["iteration"] + 1) * per_iteration} for r in rows]


def run_popmesh_gfn(name: str, plan: Plan, tmp: Path) -> Run:
    """One launch of examples/gfn_hypergrid.py as contender ``name``: 4 trainer ranks without the replay-buffer
    service (``--buffers 0``, as the Ray trials); its figures from summary.json, history, events, trace."""
    t = plan.task
    assert isinstance(t, GridTask)
    task = gfn_population.Task(t.ndim, t.height, t.r0, plan.iterations, plan.ranks, plan.every)
    flags = [*GFN_FLAGS[name], "--lr-range", f"{t.lr_range[0]:g}:{t.lr_range[1]:g}", *plan.demo_args]
    done = gfn_population.launch(gfn_population.launch_command(task, plan.seed, tmp, flags, buffers=0), tmp)
    rows = with_steps(done.rows, t.per_iteration)
    swaps = [e for e in done.events if e.get("event") == "replace"]
    trace = json.loads((tmp / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    policy_s = sum(e["dur"] for e in events if e.get("name") == "population" and e.get("cat") == "timer") / 1e6
    return {"contender": name, **plan.fields(),
            **reach(rows, done.started, swaps, l1_at_most(t.l1_target), per_row=plan.every),
            "total_s": round(done.total, 2), "exploits": len(swaps),
            "overhead_ms": round(1e3 * policy_s / len(swaps), 2) if swaps else None,
            "initial": [[significant({"lr": a["lr_start"]})["lr"]] for a in sorted(done.summary["agents"],
                                                                                   key=lambda a: a["rank"])],
            **gfn_population.figures(rows, plan.ranks), "demo_args": list(plan.demo_args)}


def run_ray_gfn(name: str, plan: Plan, tmp: Path) -> Run:
    """One Ray Tune run of contender ``name`` on the hypergrid (benchmarks/_ray_gfn.py, its own process)."""
    t = plan.task
    assert isinstance(t, GridTask)
    setup = GridSetup(scheduler=RAY_SCHEDULERS[name], seed=plan.seed, iterations=plan.iterations, every=plan.every,
                      lr_range=t.lr_range, ranks=plan.ranks, out=str(tmp), ndim=t.ndim, height=t.height, r0=t.r0,
                      batch_size=t.per_iteration, warmup=plan.warmup)
    records, started, total = run_ray_grid(setup)
    rows = [r for r in records if r["kind"] == "row"]
    starts = sorted((r for r in records if r["kind"] == "start"), key=lambda r: r["rank"])
    ranks = {r["trial"]: r["rank"] for r in starts}
    swaps = [{"rank": ranks[r["trial"]], "time": r["time"]} for r in records if r["kind"] == "restore"]
    return {"contender": name, **plan.fields(),
            **reach(rows, started, swaps, l1_at_most(t.l1_target), per_row=plan.every),
            "total_s": round(total, 2), **overhead(records), "initial": [[r["lr"]] for r in starts],
            **gfn_population.figures(rows, plan.ranks)}


def initial(rows: list[Run]) -> list[list[float]]:
    """Each rank's [lr, ent_coef] in its first history row (before any decision: its starting values)."""
    firsts = {r["rank"]: r for r in sorted(rows, key=lambda r: r["time"], reverse=True)}
    return [list(significant({"lr": r["lr"], "ent_coef": r["ent_coef"]}).values())
            for _, r in sorted(firsts.items())]


def run_one(name: str, plan: Plan) -> Run:
    """Contender ``name`` on ``plan``, in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="pbt-") as tmp:
        return plan.task.run(name, plan, Path(tmp))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--task", nargs="+", choices=tuple(TASKS), default=["cartpole"],
                        help="the tasks, one after another (default cartpole)")
    parser.add_argument("--contenders", nargs="+", choices=tuple(CONTENDERS),
                        default=[n for n in CONTENDERS if n != "shared-none"],
                        help="who runs (default all but shared-none)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per task (default 5)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help="budget per agent, rounded up to whole iterations: env steps, 512 per iteration (default "
                             "150,000); hypergrid: trajectories, 16 per iteration (default 12,800: 800 iterations)")
    parser.add_argument("--every", type=int, default=None,
                        help=f"iterations between decisions, every contender (default the demo's, {defaults.every}; "
                             "hypergrid: 25, also between validations)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"iterations before the first decision (default the demo's, {defaults.warmup}; "
                             "hypergrid: 0, the example's policy has no burn-in)")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 20,000 steps (hypergrid: 200 iterations): checks the plumbing")
    parser.add_argument("--results", type=Path, nargs="+", metavar="LOG",
                        help="run nothing: the tables of the runs these logs of earlier calls hold (their JSON lines)")
    parser.add_argument("demo_args", nargs="*", help="popmesh demo options after --, e.g. -- --strategy best_only "
                                                     "(hypergrid: examples/gfn_hypergrid.py options)")
    return parser.parse_args(argv)


def missing(names: Sequence[str], tasks: Sequence[str] = ()) -> list[str]:
    """What the chosen contenders and tasks need and this environment lacks, as the extras that bring it."""
    needs = {"ray": ("ray-pbt", "ray-pb2"), "sklearn": ("ray-pb2",), "gfn": ("hypergrid",)}
    extras = {"ray": "bench (ray[tune])", "sklearn": "pb2 (scikit-learn, for Ray's PB2)",
              "gfn": "torchgfn (pip install --no-deps torchgfn==2.4.1, for the hypergrid)"}
    chosen = set(names) | set(tasks)
    return [extras[m] for m, users in needs.items() if set(users) & chosen and importlib.util.find_spec(m) is None]


def plan_of(ns: argparse.Namespace, name: str, seed: int) -> Plan:
    """Task ``name`` on ``seed`` with the options given, the task's own defaults for those left out."""
    task = TASKS[name]
    budget = task.quick if ns.quick else ns.steps if ns.steps is not None else task.budget
    every = ns.every if ns.every is not None else task.every
    warmup = ns.warmup if ns.warmup is not None else task.warmup
    return Plan(task, seed, budget, every, warmup, demo_args=tuple(ns.demo_args))


def main() -> None:
    ns = parse()
    if ns.results:
        print(report([r for log in ns.results for r in read_jsonl(log) if "contender" in r and "task" in r]))
        return
    lacking = missing(ns.contenders, ns.task)
    if lacking:
        sys.exit(f"missing: {'; '.join(lacking)}. Install the extras: pip install -e '.[demo,bench,pb2]', or leave "
                 "the Ray contenders out (--contenders popmesh popmesh-complete none)")
    if "hypergrid" in ns.task and ns.warmup:
        sys.exit("--warmup: the hypergrid's popmesh contenders have no burn-in; leave --warmup out for it")
    seeds = 1 if ns.quick else ns.seeds
    names = [n for n in CONTENDERS if n in ns.contenders]
    runs = []
    for task in ns.task:
        for seed in range(ns.first_seed, ns.first_seed + seeds):
            plan = plan_of(ns, task, seed)
            for name in names if seed % 2 == 0 else names[::-1]:  # by the seed: one seed per call alternates too
                runs.append(run_one(name, plan))
                print(json.dumps(runs[-1]), flush=True)
    print("\n" + report(runs))


if __name__ == "__main__":
    main()
