"""Ray Tune's side of `benchmarks/population_vs_pbt.py --task hypergrid`: one hypergrid GFlowNet trainer of
examples/gfn_hypergrid.py as a Ray Tune function trainable under `PopulationBasedTraining` (ray-pbt) or
`PB2` (ray-pb2), one run per process.

:func:`spawn` (benchmarks/_ray_pbt.py's) runs this file as a script; the trials append what they do to
``rows.jsonl`` in the run's folder. Importing this module starts nothing and needs no Ray. The workers
import ``_ray_pbt`` (Ray puts the driver's script folder, benchmarks/, on their path) and
``hypergrid_agent`` from examples/ (put on their path by the trainable).

Each trial is trainer r of the example: ``hypergrid_agent.Agent(Grid(ndim, height, r0), seed=seed,
rank=r, lr=start_lr(lr_range, seed, r))``, the same environment, estimators, trajectory-balance loss,
batch (16 trajectories), Adam with the policies' parameters in group 0 and logZ (lr 0.1) in group 1,
initial weights (seeded by the seed) and sampling seeds as the example's trainers. Every ``every``
iterations (0, 25, ..., and the last) it computes the exact L1 of its terminal distribution and reports
``score`` = -L1 (what the popmesh contenders rank by), with a checkpoint (weights and Adam state) where
the scheduler may perturb it: ``every`` iterations after its last perturbation. An exploited trial takes
its donor's checkpoint, trains at the explored learning rate (group 0; logZ keeps its own) and keeps its
own rank and iteration count; it samples on from a seed of its rank and its number of exploits (a
popmesh agent keeps its sampling stream). The example's replay-buffer service is not here: it only
counts the modes the trainers sample (they train on fresh trajectories), and the popmesh contenders
run the example without it (``--buffers 0``), so every contender drives the same learner.

* ray-pbt: ``hyperparam_mutations`` log-uniform over the range for ``lr``, ``resample_probability=0.25``,
  factors 0.8/1.2, clipped to the range (the example's explore step), ``quantile_fraction=0.25``,
  ``perturbation_interval`` the example's decision cadence (``every``), ``burn_in_period`` 0 (the
  example's policy has none).
* ray-pb2: ``hyperparam_bounds`` equal to the range on a log scale (``log_lr``), the same cadence.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _ray_pbt import append, fit, read_jsonl, significant, spawn, start_ray

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

__all__ = ["GridSetup", "run"]


@dataclass(frozen=True)
class GridSetup:
    """One Ray run on the hypergrid: the scheduler (``pbt`` or ``pb2``), the seed, the budget, the cadence."""

    scheduler: str
    seed: int
    iterations: int  # the budget: iterations per trial
    every: int  # iterations between validations and perturbations
    lr_range: tuple[float, float]
    ranks: int
    out: str  # the run's folder: rows.jsonl, ray.log, Ray's own files
    ndim: int = 2
    height: int = 16
    r0: float = 0.01
    batch_size: int = 16
    hidden: int = 64
    lr_z: float = 0.1
    examples: str = str(EXAMPLES)
    warmup: int = 0  # the scheduler's burn-in (iterations), as benchmarks/_ray_pbt.scheduler reads it

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GridSetup:
        return cls(**{**data, "lr_range": tuple(data["lr_range"])})

    def ranges(self) -> dict[str, tuple[float, float]]:
        return {"lr": self.lr_range}


def run(setup: GridSetup) -> tuple[list[dict[str, Any]], float, float]:
    """Run ``setup`` in a process of its own: the trials' records, the process start and its seconds."""
    return spawn(setup, Path(__file__).resolve())


# ---- in the trials (Ray's workers) ----

def trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """One trial: the example's agent for its rank, trained to the budget (see the module docstring)."""
    import torch
    from ray import tune

    s = GridSetup.from_dict(setup)
    if s.examples not in sys.path:
        sys.path.insert(0, s.examples)
    from hypergrid_agent import Agent, Grid

    torch.set_num_threads(1)
    trial = tune.get_context().get_trial_id()
    rows = Path(s.out) / "rows.jsonl"
    mine = [r for r in read_jsonl(rows) if r.get("trial") == trial]
    rank = next((r["rank"] for r in mine if r["kind"] == "start"), config["rank"])
    lr = float(config["lr"]) if "lr" in config else math.exp(config["log_lr"])
    checkpoint = tune.get_checkpoint()
    exploits = sum(r["kind"] == "restore" for r in mine) + (checkpoint is not None)
    agent = Agent(Grid(s.ndim, s.height, s.r0), seed=s.seed, rank=rank, lr=lr, hidden=s.hidden, lr_z=s.lr_z,
                  batch_size=s.batch_size, generation=exploits)
    if not mine:
        append(rows, {"kind": "start", "trial": trial, "rank": rank, "time": time.time(), **significant({"lr": lr})})
    iteration = max((r["iteration"] for r in mine if r["kind"] == "row"), default=-1) + 1
    last = 0  # the iteration of the trial's last perturbation, as the scheduler counts it
    if checkpoint is not None:
        exploit(agent, checkpoint, lr, rows, trial, mine)
        last = iteration - 1
    train(agent, s, rows, trial, rank, iteration, last)


def train(agent: Any, s: GridSetup, rows: Path, trial: str, rank: int, iteration: int, last: int) -> None:
    """Iterate to the budget; at every validation a row and a report, with a checkpoint where the
    scheduler may perturb."""
    from ray import tune

    reported = 0.0  # seconds the previous plain tune.report took
    while iteration < s.iterations:
        agent.step()
        if iteration % s.every == 0 or iteration == s.iterations - 1:
            l1 = agent.l1()
            steps = (iteration + 1) * s.batch_size
            append(rows, {"kind": "row", "trial": trial, "rank": rank, "iteration": iteration, "steps": steps,
                          "l1": l1, "lr": agent.lr, "time": time.time(), "report_s": reported})
            result = {"iteration": iteration, "steps": steps, "l1": l1, "score": -l1}
            if iteration - last >= s.every:
                save_and_report(agent, iteration, result, rows, trial)
                last, reported = iteration, 0.0
            else:
                begin = time.perf_counter()
                tune.report(result)
                reported = time.perf_counter() - begin
        iteration += 1


def save_and_report(agent: Any, iteration: int, result: dict[str, Any], rows: Path, trial: str) -> None:
    """Write the agent (weights, Adam state) and report it with ``result``; the save and Ray's persisting
    of it are timed."""
    import torch
    from ray import tune

    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"model": agent.gflownet.state_dict(), "optimizer": agent.optimizer.state_dict(),
                    "iteration": iteration}, Path(folder) / "agent.pt")
        saved = time.perf_counter()
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(folder))
    end = time.perf_counter()
    append(rows, {"kind": "save", "trial": trial, "iteration": iteration, "save_s": saved - begin,
                  "report_s": end - saved, "time": time.time()})


def exploit(agent: Any, checkpoint: Any, lr: float, rows: Path, trial: str, mine: list[dict[str, Any]]) -> None:
    """The scheduler's exploit landed: take the donor's weights and Adam state from ``checkpoint`` and
    train at the explored ``lr``."""
    import torch

    begin = time.perf_counter()
    with checkpoint.as_directory() as folder:
        data = torch.load(Path(folder) / "agent.pt", weights_only=True)
    agent.gflownet.load_state_dict(data["model"])
    agent.optimizer.load_state_dict(data["optimizer"])
    inherited = agent.lr
    agent.set_lr(lr)
    load_s = time.perf_counter() - begin
    append(rows, {"kind": "restore", "trial": trial, "time": time.time(), "load_s": load_s,
                  "last_seen": max(r["time"] for r in mine), "restored": time.time(),
                  "donor_iteration": data["iteration"], "lr_inherited": inherited, "lr": lr})


# ---- the driver (this file run as a script) ----

def space(s: GridSetup) -> dict[str, Any]:
    """One trial per rank, each starting at the example's learning rate for that rank (its log for PB2)."""
    from ray import tune

    sys.path.insert(0, s.examples)
    from hypergrid_agent import start_lr

    def value(config: dict[str, Any]) -> float:
        lr = start_lr(s.lr_range, s.seed, config["rank"])
        return math.log(lr) if s.scheduler == "pb2" else lr

    name = "log_lr" if s.scheduler == "pb2" else "lr"
    return {"rank": tune.grid_search(list(range(s.ranks))), name: tune.sample_from(value)}


def child(s: GridSetup) -> None:
    """The Ray side of one run: ``s.ranks`` concurrent trials, one CPU each; Ray's files in ``s.out``."""
    start_ray(s.seed, s.ranks, Path(s.out))
    fit(trainable, s, space(s))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one Ray side of benchmarks/population_vs_pbt.py --task hypergrid")
    parser.add_argument("--setup", required=True, help="a GridSetup as JSON")
    child(GridSetup.from_dict(json.loads(parser.parse_args().setup)))
