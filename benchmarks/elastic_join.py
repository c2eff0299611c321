"""An elastic world's joins and leaves, timed: how long a later launcher's ranks take to train, and what a
rank lost for good costs the others.

Both cases run a lockstep data-parallel loop (loopback gloo, one launcher per node on this host): each step
every rank all-reduces a 10 MB model's gradient, waits ``--pace`` seconds (the rest of a real step), and
calls ``world.admit()``; a newcomer takes the model, Adam's state and the step with ``hand_over``.

* **join**: nodes 0 and 1 run 2 ranks each (``--nnodes 2:3``); node 2's launcher, started ``--join-after``
  seconds later, adds 2 (4 -> 6).
  Per newcomer: from its ``popmesh.init()`` (popmesh imported, its model and optimizer built) to its first
  step done (it registers, waits for the others' next ``admit()``, forms the world of 6 with them and
  takes the state), and from its launcher's start (6 interpreters importing torch on this host's cores);
  for the ranks already there, the step that took the newcomers in against their median step.
* **leave**: the same two nodes, and launcher rank 3 kills itself at step 30 with no restart left; for
  the survivors, the time from the kill to their first step done in the world of 3, as a number of
  their median steps (PeerFailure, ``world.reform()`` without it, ``hand_over`` of the step).

    python benchmarks/elastic_join.py [--reps 3] [--pace 0.1] [--join-after 4]
    (worker: popmesh launch --nnodes 2:3 --node-rank K -n 2 ... benchmarks/elastic_join.py --worker ...)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port

STARTED = time.time()
MODEL_FLOATS = 2_500_000  # 10 MB of float32
LEAVE_AT = 30


def worker(opts: argparse.Namespace) -> None:
    import torch

    import popmesh
    import popmesh.engines.torch.engine  # imported here, so that the join is timed without imports
    from popmesh.torch import hand_over

    model = torch.nn.Linear(MODEL_FLOATS // 1000, 1000)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # built first: torch's first optimizer takes a second
    script_start = time.time()
    world = popmesh.init(timeout=60)
    init_done = time.time()
    slot = world.roster[world.rank]
    newcomer = world.rank in world.newcomers
    step = hand_over(model, opt, 0) if newcomer else 0
    handed = time.time()
    steps, admits, first_done, recovered = [], [], None, None
    killed_at = None
    while step < opts.steps:
        if opts.victim == slot and step == LEAVE_AT:
            Path(opts.out, "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.perf_counter()
        try:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            for p in model.parameters():
                popmesh.all_reduce_(p.grad)
            opt.step()
        except popmesh.PeerFailure:
            world.reform()
            step = hand_over(model, opt, step, applied=step)
            recovered = True
            continue
        step += 1
        time.sleep(opts.pace)
        if recovered:
            recovered, killed_at = False, time.time()
        if first_done is None:
            first_done = time.time()
        if world.admit():
            step = hand_over(model, opt, step)
            admits.append(time.perf_counter() - began)
        else:
            steps.append(time.perf_counter() - began)
    popmesh.barrier()
    row = {"slot": slot, "newcomer": newcomer, "script_start": script_start, "first_done": first_done,
           "init_done": init_done, "handed": handed,
           "median_step": statistics.median(steps) if steps else None, "admits": admits, "size": world.size,
           "back_at": killed_at, "launcher_start": float(os.environ.get("BENCH_LAUNCHED", "nan"))}
    Path(opts.out, f"rank-{slot}.json").write_text(json.dumps(row))


def _launch(node: int, port: int, out: str, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, BENCH_LAUNCHED=str(time.time()), POPMESH_TIMEOUT="60")
    cmd = [sys.executable, "-m", "popmesh", "launch", "--nnodes", "2:3", "--node-rank", str(node), "-n", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--quiet-others", os.path.abspath(__file__), "--worker",
           "--out", out, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


def _rows(out: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))]


def join_once(opts: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as out:
        port, pace = free_port(), ["--steps", str(opts.steps), "--pace", str(opts.pace)]
        first = [_launch(node, port, out, *pace) for node in (0, 1)]
        time.sleep(opts.join_after)
        later = _launch(2, port, out, *pace)
        if any(proc.wait(timeout=600) for proc in (*first, later)):
            raise SystemExit("a launcher failed; run the worker by hand to see why")
        rows = _rows(out)
    new = [r for r in rows if r["newcomer"]]
    old = [r for r in rows if not r["newcomer"]]
    return {"script_to_step": [r["first_done"] - r["script_start"] for r in new],
            "init_s": [r["init_done"] - r["script_start"] for r in new],
            "hand_over_s": [r["handed"] - r["init_done"] for r in new],
            "launch_to_step": [r["first_done"] - r["launcher_start"] for r in new],
            "admit_steps": [r["admits"][0] / r["median_step"] for r in old if r["admits"]],
            "sizes": [r["size"] for r in rows]}


def leave_once(opts: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as out:
        port, args = free_port(), ["--steps", str(opts.steps), "--pace", str(opts.pace), "--victim", "3"]
        for proc in [_launch(node, port, out, *args) for node in (0, 1)]:
            proc.wait(timeout=600)
        killed = float(Path(out, "killed").read_text())
        rows = _rows(out)
    return {"leave_s": [r["back_at"] - killed for r in rows],
            "leave_steps": [(r["back_at"] - killed) / r["median_step"] for r in rows],
            "sizes": [r["size"] for r in rows]}


def _say(values: list[float], unit: str) -> str:
    return f"median {statistics.median(values):.2f}{unit} (range {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each case")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--pace", type=float, default=0.1, help="seconds of each step besides its all-reduce")
    parser.add_argument("--join-after", type=float, default=4.0, help="seconds between the two launchers' starts")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--victim", type=int, default=-1)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return
    joins: dict[str, list[float]] = {}
    leaves: dict[str, list[float]] = {}
    for _ in range(opts.reps):
        for key, values in join_once(opts).items():
            joins.setdefault(key, []).extend(values)
        for key, values in leave_once(opts).items():
            leaves.setdefault(key, []).extend(values)
    print(f"join, 4 -> 6 ranks ({opts.reps} runs, {len(joins['script_to_step'])} newcomers; final sizes "
          f"{sorted(set(joins['sizes']))}):")
    print("  a newcomer's popmesh.init() to its first step: " + _say(joins["script_to_step"], " s") + "; of it init() "
          + _say(joins["init_s"], " s") + ", hand_over " + _say(joins["hand_over_s"], " s"))
    print("  its launcher's start to its first step: " + _say(joins["launch_to_step"], " s"))
    print("  the admitting step of the ranks already there: " + _say(joins["admit_steps"], "x") + " their median step")
    print(f"leave, 4 -> 3 ranks ({opts.reps} runs; final sizes {sorted(set(leaves['sizes']))}):")
    print("  the kill to the survivors' first step done without it: " + _say(leaves["leave_s"], " s") + ", "
          + _say(leaves["leave_steps"], "") + " of their median steps (the pace included), the step the loss "
          "interrupted among them: " + _say([x - 1 for x in leaves["leave_steps"]], "") + " step(s) lost")

if __name__ == "__main__":
    main()
