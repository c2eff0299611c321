"""Ray Tune's side of benchmarks/population_vs_pbt.py: the demo's PPO agents as a Ray Tune function
trainable under `PopulationBasedTraining` (ray-pbt) or `PB2` (ray-pb2), one run per process.

:func:`spawn` runs this file as a script (so that Ray ships the trainable to its workers by value: it
imports nothing from benchmarks/); the trials append what they do to ``rows.jsonl`` in the run's
folder, which :func:`spawn` returns. Importing this module starts nothing and needs no Ray.

Each trial is rank r of the demo: ``PPOLearner(rank_seed(seed, r), rank_hyper(seed, r, ranges),
init_seed=seed, env=env)``. It reports every iteration (``score``, the learner's finite
:meth:`score` that the demo's population compares; ``mean_return``, which the target is judged on)
and checkpoints its agent (weights, Adam state, hyper-parameters, via the learner's own
``checkpoint()``) exactly at the iterations where the scheduler perturbs it: from ``warmup`` on,
``every`` iterations after its last perturbation (an exploited trial takes its donor's). An exploited
trial restarts from its donor's checkpoint at the explored values. A trial keeps its own rank
(seeds) and env-step count across exploits (the scheduler copies the donor's config, so both live
in rows.jsonl, keyed by the trial's id).

* ray-pbt: ``hyperparam_mutations`` log-uniform over the ranges for ``lr`` and ``ent_coef``,
  ``resample_probability=0.25``, factors 0.8/1.2, clipped to the ranges (the demo's explore step).
* ray-pb2: ``hyperparam_bounds`` equal to the ranges, on a log scale (``log_lr``, ``log_ent_coef``:
  the natural logs of the ends; PB2's GP models its bounds linearly, and the values are drawn
  log-uniformly: the wide ranges span 4 and 3 decades). PB2 takes no burn-in argument; the scheduler's burn-in is set to
  ``warmup`` all the same (the attribute PBT's check reads).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXPLORED = ("lr", "ent_coef")


@dataclass(frozen=True)
class RaySetup:
    """One Ray run: the scheduler (``pbt`` or ``pb2``), the task, its seed and budget, the cadence."""

    scheduler: str
    env: str
    target: float
    seed: int
    steps: int  # the budget: env steps per agent
    every: int  # iterations between perturbations
    warmup: int  # iterations before the first
    lr_range: tuple[float, float]
    ent_range: tuple[float, float]
    ranks: int
    out: str  # the run's folder: rows.jsonl, ray.log, Ray's own files

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RaySetup:
        return cls(**{**data, "lr_range": tuple(data["lr_range"]), "ent_range": tuple(data["ent_range"])})

    def ranges(self) -> dict[str, tuple[float, float]]:
        return {"lr": self.lr_range, "ent_coef": self.ent_range}


def spawn(setup: Any, script: Path | None = None) -> tuple[list[dict[str, Any]], float, float]:
    """Run ``setup`` (a dataclass with ``scheduler`` and ``out``) in a process of its own, ``script`` run
    with ``--setup JSON`` (default this file): the trials' records, the process start (``time.time()``)
    and its seconds. RuntimeError with the end of its log if it failed."""
    out = Path(setup.out)
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--setup", json.dumps(asdict(setup))]
    started = time.time()
    with open(out / "ray.log", "w") as log:
        done = subprocess.run(cmd, timeout=1800, stdout=log, stderr=subprocess.STDOUT)
    total = time.time() - started
    if done.returncode != 0:
        tail = (out / "ray.log").read_text()[-3000:]
        raise RuntimeError(f"Ray {setup.scheduler} failed ({done.returncode}):\n{tail}")
    return read_jsonl(out / "rows.jsonl"), started, total


def overhead(records: list[dict[str, Any]]) -> dict[str, Any]:
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
    """Every complete JSON object line of ``path`` (one being appended by a live trial may be cut short;
    other lines, such as a log's tables, are skipped)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def append(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, one O_APPEND write: trials in other processes append to the same file."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def significant(values: dict[str, float]) -> dict[str, float]:
    """``values`` to 6 significant digits (as both sides record the initial hyper-parameters)."""
    return {name: float(f"{value:.6g}") for name, value in values.items()}


# ---- in the trials (Ray's workers) ----

def explored_values(config: dict[str, Any]) -> dict[str, float]:
    """The learning rate and entropy coefficient a trial's config asks for (PB2's are logs)."""
    return {n: float(config[n]) if n in config else math.exp(config[f"log_{n}"]) for n in EXPLORED}


def trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """One trial: the demo's learner for its rank, trained to the budget (see the module docstring)."""
    import torch
    from ray import tune

    import popmesh.population.state.checkpoint  # noqa: F401  # imported at start-up, as the demo's worker does
    from popmesh.demo.config import rank_seed
    from popmesh.demo.learner import Hyper, PPOLearner

    torch.set_num_threads(1)
    s, trial = RaySetup.from_dict(setup), tune.get_context().get_trial_id()
    rows = Path(s.out) / "rows.jsonl"
    mine = [r for r in read_jsonl(rows) if r.get("trial") == trial]
    rank = next((r["rank"] for r in mine if r["kind"] == "start"), config["rank"])
    values = explored_values(config)
    learner = PPOLearner(rank_seed(s.seed, rank), Hyper(lr=values["lr"], entropy=values["ent_coef"]),
                         init_seed=s.seed, env=s.env)
    if not mine:
        append(rows, {"kind": "start", "trial": trial, "rank": rank, "time": time.time(),
                      **significant(learner.explored())})
    checkpoint = tune.get_checkpoint()
    last = exploit(learner, checkpoint, values, rows, trial, mine) if checkpoint is not None else 0
    steps = max((r["steps"] for r in mine if r["kind"] == "row"), default=0)
    train(learner, s, rows, trial, rank, steps, last)


def train(learner: Any, s: RaySetup, rows: Path, trial: str, rank: int, steps: int, last: int) -> None:
    """Iterate to the budget, reporting each iteration; with a checkpoint where the scheduler perturbs
    (``last``: the iteration of the previous perturbation, as the scheduler counts it)."""
    from ray import tune

    per_iteration = learner.hyper.rollout * learner.hyper.num_envs
    reported = 0.0  # seconds the previous iteration's plain tune.report took
    while steps < s.steps:
        learner.iterate()
        steps += per_iteration
        iteration = steps // per_iteration - 1
        metric = learner.mean_return()
        append(rows, {"kind": "row", "trial": trial, "rank": rank, "iteration": iteration, "steps": steps,
                      "time": time.time(), **learner.explored(), "report_s": reported,
                      "mean_return": None if math.isnan(metric) else metric})
        result = {"iteration": iteration, "steps": steps, "mean_return": metric, "score": learner.score()}
        if iteration >= s.warmup and iteration - last >= s.every:
            save_and_report(learner, iteration, result, rows, trial)
            last, reported = iteration, 0.0
        else:
            begin = time.perf_counter()
            tune.report(result)
            reported = time.perf_counter() - begin


def save_and_report(learner: Any, iteration: int, result: dict[str, Any], rows: Path, trial: str) -> None:
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
    append(rows, {"kind": "save", "trial": trial, "iteration": iteration, "save_s": saved - begin,
                  "report_s": end - saved, "time": time.time()})


def exploit(learner: Any, checkpoint: Any, values: dict[str, float], rows: Path, trial: str,
            mine: list[dict[str, Any]]) -> int:
    """The scheduler's exploit landed: take the donor's agent from ``checkpoint`` and train at the
    explored ``values``. The donor's iteration at that checkpoint (its last perturbation)."""
    import torch

    from popmesh.population.state.checkpoint import AgentState

    begin = time.perf_counter()
    with checkpoint.as_directory() as folder:
        data = torch.load(Path(folder) / "agent.pt", weights_only=True)
    learner.restore(AgentState(**data))
    inherited = learner.explored()
    learner.set_hyper(**values)
    load_s = time.perf_counter() - begin
    append(rows, {"kind": "restore", "trial": trial, "time": time.time(), "load_s": load_s,
                  "last_seen": max(r["time"] for r in mine), "restored": time.time(),
                  "donor_iteration": data["counters"]["iteration"],
                  **{f"{n}_inherited": v for n, v in inherited.items()}, **learner.explored()})
    return int(data["counters"]["iteration"])


# ---- the driver (this file run as a script) ----

class TargetStopper:
    """Stop a trial at the budget, and every trial once one reached the target (the demo's
    --stop-at-target)."""

    def __init__(self, cap: int, target: float) -> None:
        self.cap, self.target, self.reached = cap, target, False

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if result.get("mean_return", math.nan) >= self.target:
            self.reached = True
        return bool(result["steps"] >= self.cap)

    def stop_all(self) -> bool:
        return self.reached


def scheduler(s: RaySetup) -> Any:
    """Asynchronous PBT or PB2 at the demo's cadence, burn-in and quantile (see the module docstring)."""
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    common: dict[str, Any] = dict(time_attr="iteration", metric="score", mode="max", perturbation_interval=s.every,
                                  quantile_fraction=0.25)
    ranges = s.ranges()
    if s.scheduler == "pb2":
        from ray.tune.schedulers.pb2 import PB2  # needs scikit-learn

        pb2 = PB2(**common, hyperparam_bounds={f"log_{n}": [math.log(lo), math.log(hi)] for n, (lo, hi) in
                                               ranges.items()})
        pb2._burn_in_period = s.warmup  # PB2 does not pass burn_in_period on to PBT, whose check reads this
        return pb2

    def clip(config: dict[str, Any]) -> dict[str, Any]:
        return {**config, **{n: min(max(config[n], lo), hi) for n, (lo, hi) in ranges.items()}}

    return PopulationBasedTraining(
        **common, burn_in_period=s.warmup, resample_probability=0.25, perturbation_factors=(1.2, 0.8),
        hyperparam_mutations={n: tune.loguniform(lo, hi) for n, (lo, hi) in ranges.items()}, custom_explore_fn=clip)


def space(s: RaySetup) -> dict[str, Any]:
    """One trial per rank, each starting at the demo's values for that rank (logs for PB2)."""
    from ray import tune

    from popmesh.demo.config import rank_hyper

    def start(name: str) -> Any:
        def value(config: dict[str, Any]) -> float:
            hyper = rank_hyper(s.seed, config["rank"], s.lr_range, s.ent_range)
            v = hyper.lr if name == "lr" else hyper.entropy
            return math.log(v) if s.scheduler == "pb2" else v

        return tune.sample_from(value)

    prefix = "log_" if s.scheduler == "pb2" else ""
    return {"rank": tune.grid_search(list(range(s.ranks))), **{f"{prefix}{n}": start(n) for n in EXPLORED}}


def start_ray(seed: int, ranks: int, out: Path) -> None:
    """Seed the schedulers' draws and start Ray with ``ranks`` CPUs, its files under ``out``."""
    import numpy as np
    import ray

    random.seed(seed)  # PBT draws donors and perturbations from Python's random, PB2 also numpy's
    np.random.seed(seed)
    ray.init(num_cpus=ranks, include_dashboard=False, log_to_driver=False, _temp_dir=str(out / "ray"),
             logging_level=logging.WARNING)


def child(s: RaySetup) -> None:
    """The Ray side of one run: ``s.ranks`` concurrent trials, one CPU each; Ray's files in ``s.out``."""
    from ray import tune

    start_ray(s.seed, s.ranks, Path(s.out))

    class Stopper(TargetStopper, tune.Stopper):
        """The target stopper as Ray Tune takes it."""

    fit(trainable, s, space(s), stop=Stopper(s.steps, s.target))


def fit(trainable: Any, s: Any, param_space: dict[str, Any], stop: Any = None) -> None:
    """Run ``s.ranks`` concurrent trials of ``trainable`` (one CPU each, actors reused) under ``s``'s
    scheduler, Ray's files in ``s.out``; shut Ray down after; SystemExit naming the first failed trial."""
    import ray
    from ray import tune

    fn = tune.with_resources(tune.with_parameters(trainable, setup=asdict(s)), {"cpu": 1})
    tuner = tune.Tuner(fn, param_space=param_space,
                       tune_config=tune.TuneConfig(scheduler=scheduler(s), reuse_actors=True,
                                                   max_concurrent_trials=s.ranks),
                       run_config=tune.RunConfig(name=s.scheduler, storage_path=str(Path(s.out) / "results"),
                                                 verbose=0, stop=stop))
    results = tuner.fit()
    ray.shutdown()
    if results.errors:
        raise SystemExit(f"{len(results.errors)} trial(s) failed; the first: {results.errors[0]!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one Ray side of benchmarks/population_vs_pbt.py")
    parser.add_argument("--setup", required=True, help="a RaySetup as JSON")
    child(RaySetup.from_dict(json.loads(parser.parse_args().setup)))
