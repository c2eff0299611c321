"""Population policies over GFlowNets on torchgfn's hypergrid: the same trainers (examples/gfn_hypergrid.py),
four policies, seed by seed.

The task (the defaults): 2-D hypergrid of height 16, R0 = 0.01 (R1 0.5, R2 2: four modes, separated by
low reward), trajectory balance, 4 trainers (with a replay-buffer manager and the coordinator: 6 ranks),
1,000 iterations of 16 trajectories per trainer. Every trainer starts from the same initial weights
(seeded by the seed) at its own learning rate, drawn log-uniformly from 1e-5..1e-1 per seed and rank,
the same for every contender; every 25 iterations it computes the exact L1 distance between the
distribution of its terminal states and the target (reward / Z).

Contenders (`--contenders`, default all), one after another for each seed, in reverse order every
other seed, each its own `popmesh launch`:

* `none`: no population policy (torch engine);
* `average`: popmesh's `AverageAll` every 25 iterations (torch engine);
* `popmesh`: popmesh's `AsyncSelectiveAveraging` with `decide="latest"` every 25 iterations (torch
  engine): each agent judged the moment it reports, ranked by -L1 (`objective=`); one in the bottom
  quarter that trails by both gaps takes the mean of the (up to) two best agents' weights and its best
  donor's learning rate, explored (x0.8/x1.2, or resampled with p = 0.25);
* `torchgfn`: torchgfn's own selective policy, `AsyncSelectiveAveragingPolicympi4pyGeneral` through
  `popmesh.compat.spawn_policy`, on an MPI world started by mpiexec (`popmesh launch --engine mpi`):
  every 25 iterations the worst quarter by -L1 (`replacement_mode="worst_ratio"`, ratio 0.25) takes the
  mean of max(1, n/2) other agents drawn at random, read through MPI windows; learning rates are kept.

Per run: the population-mean and the worst agent's L1, at the last validation and averaged over all
validations; the first iteration at which one agent had sampled every mode, and at which the population
had (every mode by some agent); replacements; wall time. One JSON line per run as it ends, the tables at
the end; `--results LOG...` prints the tables of earlier calls' lines, so runs go one seed per call:

    python benchmarks/gfn_population.py --first-seed 0 --seeds 1 | tee -a hypergrid.log
    python benchmarks/gfn_population.py --results hypergrid.log
    python benchmarks/gfn_population.py --quick                 # one seed, 200 iterations: the plumbing

Needs torchgfn (`pip install --no-deps torchgfn==2.4.1`), mpi4py and MPICH (the `mpi` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import HERE
from _pbt_tables import l1_spread, sign_test, spread
from _ray_pbt import read_jsonl
from popmesh.demo.hypergrid import PRELOAD

Run = dict[str, Any]
EXAMPLE = HERE.parent / "examples" / "gfn_hypergrid.py"
CONTENDERS = {"none": "none", "average": "average", "popmesh": "selective", "torchgfn": "torchgfn"}  # -> --policy
ENGINES = {"torchgfn": "mpi"}  # the others: torch


@dataclass(frozen=True)
class Task:
    """What every contender of one seed shares."""

    ndim: int = 2
    height: int = 16
    r0: float = 0.01
    iterations: int = 1000
    trainers: int = 4
    every: int = 25

    @property
    def key(self) -> str:
        return f"{self.ndim}-D, height {self.height}, R0 {self.r0:g}, {self.iterations} iterations, " \
               f"{self.trainers} trainers, every {self.every}"


def command(name: str, task: Task, seed: int, out: Path) -> list[str]:
    """The `popmesh launch` of contender ``name``."""
    return launch_command(task, seed, out, ["--policy", CONTENDERS[name]], ENGINES.get(name, "torch"))


def launch_command(task: Task, seed: int, out: Path, flags: Sequence[str], engine: str = "torch",
                   buffers: int = 1) -> list[str]:
    """The `popmesh launch` of the example on ``task`` with ``flags`` (its policy's, and any other):
    ``task.trainers`` trainer ranks, with ``buffers`` replay-buffer managers and the coordinator
    (none of either for 0)."""
    ranks = task.trainers + (buffers + 1 if buffers else 0)
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(ranks), "--engine", engine, "--quiet-others"]
    if engine == "torch":
        cmd += ["--preload", ",".join(PRELOAD)]
    return cmd + [str(EXAMPLE), "--buffers", str(buffers), "--ndim", str(task.ndim), "--height", str(task.height),
                  "--r0", str(task.r0), "--iterations", str(task.iterations), "--every", str(task.every),
                  "--validate-every", str(task.every), "--seed", str(seed), "--out", str(out), *flags]


@dataclass(frozen=True)
class Launched:
    """What one launch of the example left: summary.json, history.jsonl's rows, events.jsonl's, and its
    start (``time.time()``) and seconds."""

    summary: dict[str, Any]
    rows: list[Run]
    events: list[Run]
    started: float
    total: float


def launch(cmd: list[str], out: Path) -> Launched:
    """Run ``cmd`` (writing into ``out``) and read what it wrote; RuntimeError with its stderr's end if it failed."""
    started = time.time()
    done = subprocess.run(cmd, timeout=1800, capture_output=True, text=True)
    total = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Launched(json.loads((out / "summary.json").read_text()), read_jsonl(out / "history.jsonl"),
                    read_jsonl(out / "events.jsonl"), started, total)


def run_one(name: str, task: Task, seed: int) -> Run:
    """Contender ``name`` on ``task`` and ``seed``, in a temporary folder; its figures."""
    with tempfile.TemporaryDirectory(prefix="gfn-") as tmp:
        done = launch(command(name, task, seed, Path(tmp)), Path(tmp))
    summary, rows, total = done.summary, done.rows, done.total
    events = [e for e in done.events if e.get("event") == "replace"]
    return {"contender": name, "seed": seed, "task": asdict(task), **figures(rows, task.trainers),
            "all_modes_agent": summary["all_modes_at"]["any_agent"],
            "all_modes_population": summary["all_modes_at"]["population"], "replacements": len(events),
            "lr_start": [a["lr_start"] for a in summary["agents"]], "wall_s": round(total, 1),
            "train_s": round(max(r["time"] for r in rows) - min(r["time"] for r in rows), 1)}


def figures(rows: list[Run], trainers: int) -> Run:
    """The population-mean and worst-agent L1 at the last validation and averaged over the validations
    (those every trainer reported), with the curve of both."""
    by: dict[int, list[float]] = {}
    for row in rows:
        by.setdefault(row["iteration"], []).append(row["l1"])
    curve = [[it, statistics.fmean(l1), max(l1)] for it, l1 in sorted(by.items()) if len(l1) == trainers]
    last = curve[-1]
    return {"final_mean_l1": last[1], "final_worst_l1": last[2], "mean_mean_l1": statistics.fmean(c[1] for c in curve),
            "mean_worst_l1": statistics.fmean(c[2] for c in curve),
            "curve": [[it, round(mean, 4), round(worst, 4)] for it, mean, worst in curve]}


# ---- the tables (markdown) ----

def charged(run: Run, key: str) -> int:
    """The first iteration at which every mode was found, or the iterations run where that never happened."""
    return int(run[key]) if run[key] is not None else int(run["task"]["iterations"])


def modes_spread(runs: Sequence[Run], key: str) -> str:
    """The first iteration with every mode found, ``median (range)``, and in how many runs never."""
    never = sum(r[key] is None for r in runs)
    return spread([charged(r, key) for r in runs]) + (f", never in {never}" if never else "")


def summary_table(by: dict[str, list[Run]]) -> str:
    """Per contender, median (range) over the seeds of every figure."""
    lines = ["| contender | runs | final L1, population mean | final L1, worst agent | mean L1 over validations, "
             "population mean | mean L1 over validations, worst agent | every mode, one agent | every mode, "
             "population | replacements | wall | training |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in by.items():
        l1 = {key: l1_spread([r[key] for r in runs]) for key in ("final_mean_l1", "final_worst_l1", "mean_mean_l1",
                                                                  "mean_worst_l1")}
        lines.append(f"| {name} | {len(runs)} | {l1['final_mean_l1']} | {l1['final_worst_l1']} | "
                     f"{l1['mean_mean_l1']} | {l1['mean_worst_l1']} | {modes_spread(runs, 'all_modes_agent')} | "
                     f"{modes_spread(runs, 'all_modes_population')} | {spread([r['replacements'] for r in runs])} | "
                     f"{spread([r['wall_s'] for r in runs], ' s')} | {spread([r['train_s'] for r in runs], ' s')} |")
    return "\n".join(lines)


def per_seed_table(by: dict[str, list[Run]]) -> str:
    """One column per seed; per contender the final and mean L1 and when every mode was found."""
    seeds = sorted({r["seed"] for runs in by.values() for r in runs})
    lines = ["| | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    rows = (("final L1 mean / worst", lambda r: f"{r['final_mean_l1']:.3f} / {r['final_worst_l1']:.3f}"),
            ("mean L1 mean / worst", lambda r: f"{r['mean_mean_l1']:.3f} / {r['mean_worst_l1']:.3f}"),
            ("every mode: agent / population", lambda r: f"{_it(r['all_modes_agent'])} / "
                                                          f"{_it(r['all_modes_population'])}"))
    for name, runs in by.items():
        at = {r["seed"]: r for r in runs}
        for label, cell in rows:
            lines.append(f"| {name}: {label} | " + " | ".join(cell(at[s]) if s in at else "—" for s in seeds) + " |")
    return "\n".join(lines)


def _it(value: int | None) -> str:
    return "never" if value is None else str(value)


def comparison_table(by: dict[str, list[Run]]) -> str:
    """popmesh against every other contender, seed by seed: lower / higher / equal L1, the sign test."""
    ours = {r["seed"]: r for r in by.get("popmesh", [])}
    lines = ["| popmesh against | seeds | final mean L1: lower / higher / equal, p | final worst L1: lower / higher "
             "/ equal, p | mean L1 over validations: lower / higher / equal, p |", "|---|---|---|---|---|"]
    for name, runs in by.items():
        theirs = {r["seed"]: r for r in runs}
        both = sorted(set(ours) & set(theirs))
        if name == "popmesh" or not both:
            continue
        cells = []
        for key in ("final_mean_l1", "final_worst_l1", "mean_mean_l1"):
            diffs = [ours[s][key] - theirs[s][key] for s in both]
            lower, higher = sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)
            cells.append(f"{lower} / {higher} / {len(both) - lower - higher}, p = {sign_test(lower, higher):.3g}")
        lines.append(f"| {name} | {len(both)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def report(runs: list[Run]) -> str:
    """Every task's tables (the later run where a contender and seed repeat)."""
    kept = {(Task(**r["task"]).key, r["contender"], r["seed"]): r for r in runs}
    parts = []
    for key in dict.fromkeys(k for k, _, _ in kept):
        mine = [r for (k, _, _), r in kept.items() if k == key]
        by = {n: sorted((r for r in mine if r["contender"] == n), key=lambda r: r["seed"]) for n in CONTENDERS}
        by = {n: rs for n, rs in by.items() if rs}
        starts = {s: {tuple(r["lr_start"]) for r in mine if r["seed"] == s} for s in {r["seed"] for r in mine}}
        odd = sorted(s for s, found in starts.items() if len(found) > 1)
        parts += [f"### Hypergrid: {key}", summary_table(by), per_seed_table(by), comparison_table(by)]
        if odd:
            parts.append(f"**Warning**: seeds {odd} did not start every contender at the same learning rates.")
    notes = ("L1: the exact L1 distance between an agent's distribution of terminal states and the target, 0 to 2 "
             "(lower is better). Every mode: the first iteration at which one agent had sampled all of them, or the "
             "population had (each by some agent); a run where that never happened counts as its iterations. "
             "Wall: the whole launch; training: from the trainers' first validation to their last.")
    return "\n\n".join([*parts, notes])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Task()
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--contenders", nargs="+", choices=tuple(CONTENDERS), default=list(CONTENDERS))
    p.add_argument("--seeds", type=int, default=5, help="seeds (default 5)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--ndim", type=int, default=defaults.ndim)
    p.add_argument("--height", type=int, default=defaults.height)
    p.add_argument("--r0", type=float, default=defaults.r0)
    p.add_argument("--iterations", type=int, default=defaults.iterations)
    p.add_argument("--trainers", type=int, default=defaults.trainers)
    p.add_argument("--every", type=int, default=defaults.every, help="iterations between decisions and validations")
    p.add_argument("--quick", action="store_true", help="one seed, 200 iterations: checks the plumbing")
    p.add_argument("--results", type=Path, nargs="+", metavar="LOG",
                   help="run nothing: the tables of the runs these logs of earlier calls hold (their JSON lines)")
    return p.parse_args(argv)


def main() -> None:
    ns = parse()
    if ns.results:
        print(report([r for log in ns.results for r in read_jsonl(log) if "contender" in r and "task" in r]))
        return
    task = Task(ns.ndim, ns.height, ns.r0, 200 if ns.quick else ns.iterations, ns.trainers, ns.every)
    names = [n for n in CONTENDERS if n in ns.contenders]
    runs = []
    for seed in range(ns.first_seed, ns.first_seed + (1 if ns.quick else ns.seeds)):
        for name in names if seed % 2 == 0 else names[::-1]:  # one seed per call alternates too
            runs.append(run_one(name, task, seed))
            print(json.dumps(runs[-1]), flush=True)
    print("\n" + report(runs))


if __name__ == "__main__":
    main()
