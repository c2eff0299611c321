"""popmesh's asynchronous selective averaging against Ray Tune's PopulationBasedTraining, on the demo's
CartPole PPO agents: the same agent code, 4 agents at once on the same cores, the same cap.

* **popmesh**: `popmesh demo --stop-at-target` with its defaults (4 ranks on torch/gloo, policy
  `async`: every 10 iterations after a 20-iteration warm-up the worst quarter is replaced by the mean
  of the two best, and its inherited learning rate explored).
* **Ray Tune PBT**: the demo's `CartPoleLearner` as a function trainable, 4 concurrent trials
  (`ray.init(num_cpus=4)`, one CPU each, `reuse_actors=True` as Ray advises for PBT), asynchronous
  `PopulationBasedTraining` with the closest settings: `perturbation_interval=10` and
  `burn_in_period=20` iterations, `quantile_fraction=0.25` (1 of 4), the learning rate explored
  ×0.8/×1.2 or resampled (log-uniform 2e-4..6e-3) with p = 0.25 and clipped to that range, as the
  demo's explore. Each trial starts from the demo's rank r hyper-parameters and seeds, checkpoints
  (weights, Adam state, hyper-parameters, via the learner's own `checkpoint()`) at the iterations
  where PBT may perturb it, and an exploited trial restarts from its donor's checkpoint.

Both sides: one torch thread per agent; the target is the demo's (an agent's mean return over its last
20 episodes ≥ 475; steps are that agent's own env steps, 512 per iteration); each run its own process,
timed from its start. Runs alternate per seed (popmesh seed 0, Ray seed 0, popmesh seed 1, ...).
Per run: steps to 475 (that agent's, and the population's summed), wall time to 475 from the process
start and from the end of the first iteration (i.e. without start-up), and the overhead per exploit
(popmesh: main-thread time in the policy calls of every rank, from trace.json, per replacement; Ray:
checkpoint saves of every trial plus each exploited trial's interruption, from its last report to
training again on the donor's checkpoint, per exploit).

Ray is needed only here: `pip install -e '.[demo,bench]'` (the `bench` extra is `ray[tune]`), then

    python benchmarks/population_vs_pbt.py [--seeds 5] [--first-seed 0] [--steps 150000] [-- DEMO OPTIONS]

`--quick` checks the plumbing (one seed, 20,000 steps); `--results LOG...` prints the tables of earlier
calls' JSON lines (one seed per call, e.g. to run each when the machine is quiet); options after `--` go to
`popmesh demo` (e.g. `-- --strategy best_only`, PBT's exploit of one donor). Figures: docs/population.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from popmesh.demo.outputs import steps_to_target

TARGET = 475.0
EVERY, WARMUP = 10, 20  # the demo's defaults: iterations between decisions, iterations before the first
PER_ITERATION = 512  # the demo's rollout (64) times its environments (8)
RANKS = 4


def run_popmesh(seed: int, steps: int, tmp: Path, extra: list[str]) -> dict[str, Any]:
    """One `popmesh demo` run (with ``extra`` options); its figures from summary.json, history.jsonl and
    trace.json."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--seed", str(seed), "--steps", str(steps), "--ranks",
           str(RANKS), "--stop-at-target", "--no-live", "--out", str(tmp), *extra]
    started = time.time()
    done = subprocess.run(cmd, timeout=1800, capture_output=True, text=True)
    total = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    run = next(tmp.glob("*/summary.json")).parent
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    trace = json.loads((run / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    policy_s = sum(e["dur"] for e in events if e.get("name") == "population" and e.get("cat") == "timer") / 1e6
    replaced = summary["replacements"]
    swaps = [e for e in read_jsonl(run / "events.jsonl") if "kind" not in e]
    return {"contender": "popmesh", "seed": seed, **reach(rows, started, swaps), "total_s": round(total, 2),
            "exploits": replaced, "overhead_ms": round(1e3 * policy_s / replaced, 2) if replaced else None}


def reach(rows: list[dict[str, Any]], started: float, swaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo's target in a history (rows with rank, steps, mean_return, time): the first row at or
    above it (its agent's steps and rank, and whether ``swaps``, exploits with rank and time, had
    replaced that agent before), the population's steps then, and the times from ``started``."""
    rows = sorted(rows, key=lambda r: r["time"])
    first = rows[0]["time"]
    hit = next((r for r in rows if r["mean_return"] is not None and r["mean_return"] >= TARGET), None)
    out: dict[str, Any] = {"startup_s": round(first - started, 2),
                           "iteration_ms": iteration_ms(rows), "steps": None, "population_steps": None,
                           "wall_s": None, "train_s": None}
    if hit is not None:
        out.update(steps=hit["steps"], population_steps=steps_to_target(rows, TARGET), rank=hit["rank"],
                   was_replaced=any(e["rank"] == hit["rank"] and e["time"] < hit["time"] for e in swaps),
                   wall_s=round(hit["time"] - started, 2), train_s=round(hit["time"] - first, 2))
    return out


def iteration_ms(rows: list[dict[str, Any]]) -> float:
    """The median time between an agent's consecutive rows (one iteration, and whatever it waited)."""
    laps: list[float] = []
    for rank in {r["rank"] for r in rows}:
        times = [r["time"] for r in rows if r["rank"] == rank]
        laps += [b - a for a, b in itertools.pairwise(times)]
    return round(1e3 * statistics.median(laps), 1)


def run_ray(seed: int, steps: int, tmp: Path) -> dict[str, Any]:
    """One Ray Tune PBT run in its own process (this script with --ray-child); its rows and events."""
    cmd = [sys.executable, __file__, "--ray-child", str(tmp), "--first-seed", str(seed), "--steps", str(steps)]
    started = time.time()
    with open(tmp / "ray.log", "w") as log:
        done = subprocess.run(cmd, timeout=1800, stdout=log, stderr=subprocess.STDOUT)
    total = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{(tmp / 'ray.log').read_text()[-3000:]}")
    records = read_jsonl(tmp / "rows.jsonl")
    rows = [r for r in records if r["kind"] == "row"]
    ranks = {r["trial"]: r["rank"] for r in records if r["kind"] == "start"}
    swaps = [{"rank": ranks[r["trial"]], "time": r["time"]} for r in records if r["kind"] == "restore"]
    return {"contender": "ray", "seed": seed, **reach(rows, started, swaps), "total_s": round(total, 2),
            **ray_overhead(records)}


def ray_overhead(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray's cost of exploiting: every checkpoint (the save, and its report's time beyond a plain
    report's) plus each exploited trial's interruption (its last record to training on the donor's
    checkpoint), per exploit; and the parts."""
    plain = [r["report_s"] for r in records if r["kind"] == "row" and r["report_s"] > 0]
    report = statistics.median(plain) if plain else 0.0
    saves = [r["save_s"] + max(r["report_s"] - report, 0.0) for r in records if r["kind"] == "save"]
    restores = [r for r in records if r["kind"] == "restore"]
    gaps = [r["restored"] - r["last_seen"] for r in restores]
    cost = sum(saves) + sum(gaps)

    def ms(values: list[float]) -> float | None:
        return round(1e3 * statistics.median(values), 2) if values else None

    return {"exploits": len(restores), "overhead_ms": round(1e3 * cost / len(restores), 2) if restores else None,
            "saves": len(saves), "save_ms": ms(saves), "restart_ms": ms(gaps),
            "load_ms": ms([r["load_s"] for r in restores]), "report_ms": ms(plain)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of ``path`` (one being appended by a live trial may be cut short)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def append(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, one O_APPEND write: trials in other processes append to the same file."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ---- the Ray side: runs in the --ray-child process and its Ray workers ----

def trainable(config: dict[str, Any]) -> None:
    """One trial: the demo's CartPoleLearner, reporting every iteration and checkpointing where PBT may
    perturb it. A trial keeps its own rank (seeds) and env-step count across exploits (PBT copies the
    donor's config, so both live in rows.jsonl, keyed by the trial's id)."""
    import torch
    from ray import tune

    import popmesh.population.state.checkpoint  # noqa: F401  # imported at start-up, as the demo's worker does
    from popmesh.demo.config import rank_seed
    from popmesh.demo.learner import CartPoleLearner, Hyper

    torch.set_num_threads(1)
    out, trial = Path(config["out"]), tune.get_context().get_trial_id()
    mine = [r for r in read_jsonl(out / "rows.jsonl") if r.get("trial") == trial]
    rank = next((r["rank"] for r in mine if r["kind"] == "start"), config["rank"])
    if not mine:
        append(out / "rows.jsonl", {"kind": "start", "trial": trial, "rank": rank, "time": time.time()})
    steps = max((r["steps"] for r in mine if r["kind"] == "row"), default=0)
    learner = CartPoleLearner(rank_seed(config["seed"], rank), Hyper(lr=config["lr"], entropy=config["entropy"]),
                              init_seed=config["seed"])
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        exploit(learner, checkpoint, config["lr"], out, trial, mine)
    reported = 0.0  # seconds the previous iteration's plain tune.report took
    while steps < config["steps"]:
        learner.iterate()
        steps += PER_ITERATION
        iteration = steps // PER_ITERATION - 1
        metric = learner.mean_return()
        append(out / "rows.jsonl", {"kind": "row", "trial": trial, "rank": rank, "iteration": iteration,
                                    "steps": steps, "time": time.time(), "lr": learner.learning_rate(),
                                    "report_s": reported, "mean_return": None if math.isnan(metric) else metric})
        result = {"iteration": iteration, "steps": steps, "mean_return": metric}
        if iteration >= WARMUP and iteration % EVERY == 0:
            save_and_report(learner, iteration, result, out, trial)
            reported = 0.0
        else:
            begin = time.perf_counter()
            tune.report(result)
            reported = time.perf_counter() - begin


def save_and_report(learner: Any, iteration: int, result: dict[str, Any], out: Path, trial: str) -> None:
    """Write the agent (the learner's own checkpoint: weights, Adam state, hyper-parameters, counters)
    and report it with ``result``; the save and Ray's persisting of it are timed."""
    import torch
    from ray import tune

    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        torch.save(learner.checkpoint(iteration).to_dict(), Path(folder) / "agent.pt")
        saved = time.perf_counter()
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(folder))
    end = time.perf_counter()
    append(out / "rows.jsonl", {"kind": "save", "trial": trial, "iteration": iteration, "save_s": saved - begin,
                                "report_s": end - saved, "time": time.time()})


def exploit(learner: Any, checkpoint: Any, lr: float, out: Path, trial: str, mine: list[dict[str, Any]]) -> None:
    """PBT's exploit landed: take the donor's agent from ``checkpoint`` and train at the explored ``lr``."""
    import torch

    from popmesh.population.state.checkpoint import AgentState

    begin = time.perf_counter()
    with checkpoint.as_directory() as folder:
        data = torch.load(Path(folder) / "agent.pt", weights_only=True)
    learner.restore(AgentState(**data))
    inherited = learner.learning_rate()
    learner.set_learning_rate(lr)
    load_s = time.perf_counter() - begin
    append(out / "rows.jsonl", {"kind": "restore", "trial": trial, "time": time.time(), "load_s": load_s,
                                "last_seen": max(r["time"] for r in mine), "restored": time.time(),
                                "donor_iteration": data["counters"]["iteration"], "lr_inherited": inherited, "lr": lr})


class TargetStopper:
    """Stop a trial at the step cap, and every trial once one reached the target (the demo's
    --stop-at-target)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.reached = cap, False

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if result.get("mean_return", math.nan) >= TARGET:
            self.reached = True
        return bool(result["steps"] >= self.cap)

    def stop_all(self) -> bool:
        return self.reached


def ray_child(out: Path, seed: int, steps: int) -> None:
    """The Ray side of one run: 4 concurrent trials under asynchronous PBT, Ray's files in ``out``."""
    import ray
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    from popmesh.demo.config import LR_RANGE, rank_hyper

    random.seed(seed)  # PBT draws donors and perturbations from Python's random
    ray.init(num_cpus=RANKS, include_dashboard=False, log_to_driver=False, _temp_dir=str(out / "ray"),
             logging_level="warning")
    pbt = PopulationBasedTraining(
        time_attr="iteration", metric="mean_return", mode="max", perturbation_interval=EVERY, burn_in_period=WARMUP,
        quantile_fraction=0.25, resample_probability=0.25, perturbation_factors=(1.2, 0.8),
        hyperparam_mutations={"lr": tune.loguniform(*LR_RANGE)},
        custom_explore_fn=lambda c: {**c, "lr": min(max(c["lr"], LR_RANGE[0]), LR_RANGE[1])})
    space = {"rank": tune.grid_search(list(range(RANKS))), "seed": seed, "steps": steps, "out": str(out),
             "lr": tune.sample_from(lambda c: rank_hyper(seed, c["rank"]).lr),
             "entropy": tune.sample_from(lambda c: rank_hyper(seed, c["rank"]).entropy)}

    class Stopper(TargetStopper, tune.Stopper):
        """The target stopper as Ray Tune takes it."""

    tuner = tune.Tuner(tune.with_resources(trainable, {"cpu": 1}), param_space=space,
                       tune_config=tune.TuneConfig(scheduler=pbt, reuse_actors=True, max_concurrent_trials=RANKS),
                       run_config=tune.RunConfig(name="pbt", storage_path=str(out / "results"), verbose=0,
                                                 stop=Stopper(steps)))
    tuner.fit()
    ray.shutdown()


# ---- the report ----

def spread(values: list[Any], unit: str = "") -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "—"
    fmt = (lambda v: f"{v:,.0f}") if unit == "" else (lambda v: f"{v:.1f}{unit}")
    return f"{fmt(statistics.median(known))} ({fmt(min(known))}–{fmt(max(known))})"


def table(rows: list[dict[str, Any]], cap: int) -> str:
    """Median (range) of each figure per contender, as docs/population.md shows them."""
    lines = ["| | steps to 475 (agent) | population steps | wall to 475 | without start-up | start-up | "
             "missed | exploits | overhead per exploit | per iteration |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("popmesh", "ray"):
        mine = [r for r in rows if r["contender"] == name]
        missed = sum(r["steps"] is None for r in mine)
        lines.append(f"| {name} | {spread([r['steps'] for r in mine])} | "
                     f"{spread([r['population_steps'] for r in mine])} | {spread([r['wall_s'] for r in mine], ' s')} | "
                     f"{spread([r['train_s'] for r in mine], ' s')} | {spread([r['startup_s'] for r in mine], ' s')} | "
                     f"{missed} of {len(mine)} (cap {cap:,}) | {spread([r['exploits'] for r in mine])} | "
                     f"{spread([r['overhead_ms'] for r in mine], ' ms')} | "
                     f"{spread([r.get('iteration_ms') for r in mine], ' ms')} |")
    return "\n".join(lines)


def per_seed(rows: list[dict[str, Any]]) -> str:
    """One line per seed: each contender's steps to 475 (the agent that got there first, * if the
    population had replaced it before) and its wall time to 475."""
    lines = ["| seed | popmesh steps (agent) | Ray steps (agent) | popmesh wall | Ray wall |", "|---|---|---|---|---|"]
    for seed in sorted({r["seed"] for r in rows}):
        cells = []
        for name in ("popmesh", "ray"):
            run = next((r for r in rows if r["seed"] == seed and r["contender"] == name), None)
            hit = run is not None and run["steps"] is not None
            cells.append((f"{run['steps']:,} (rank {run['rank']}{'*' if run['was_replaced'] else ''})",
                          f"{run['wall_s']:.1f} s") if hit else ("—", "—"))
        lines.append(f"| {seed} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150_000, help="cap on env steps per agent, both contenders")
    parser.add_argument("--quick", action="store_true", help="one seed, 20,000 steps: checks the plumbing")
    parser.add_argument("--only", choices=("popmesh", "ray"), help="run one contender")
    parser.add_argument("--results", type=Path, nargs="+", metavar="LOG",
                        help="run nothing: the table of the runs these logs of earlier calls hold (their JSON lines)")
    parser.add_argument("--ray-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("demo_args", nargs="*", help="popmesh demo options after --, e.g. -- --strategy best_only")
    ns = parser.parse_args()
    if ns.ray_child is not None:
        return ray_child(ns.ray_child, ns.first_seed, ns.steps)
    if ns.results:
        rows = [r for log in ns.results for r in read_jsonl(log)]
        print(table(rows, ns.steps) + "\n\n" + per_seed(rows))
        return
    seeds, steps = (1, 20_000) if ns.quick else (ns.seeds, ns.steps)
    contenders: dict[str, Any] = {"popmesh": lambda seed, tmp: run_popmesh(seed, steps, tmp, ns.demo_args),
                                  "ray": lambda seed, tmp: run_ray(seed, steps, tmp)}
    rows = []
    for seed in range(ns.first_seed, ns.first_seed + seeds):
        for name, run in contenders.items():
            if ns.only in (None, name):
                with tempfile.TemporaryDirectory(prefix="pbt-") as tmp:
                    rows.append(run(seed, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    print("\n" + table(rows, steps) + "\n\n" + per_seed(rows))


if __name__ == "__main__":
    main()
