"""What whole-population checkpoints cost.

1. In the demo (4 ranks, async policy, torch/gloo): runs without checkpoints and with
   ``--checkpoint-every K`` alternate; each run's summary says how long rank 0 spent in checkpoints.
   Printed: seconds per checkpoint, their share of the run, and the paired wall-time ratio.
2. One save, in a world of one: popmesh's atomic save (temporary file, fsync, rename, SHA-256,
   manifest) against what users write today, a bare ``torch.save(state, path)``, on the demo's agent.

Run: .venv/bin/python benchmarks/checkpoint.py [--rounds 3] [--steps 40000] [--every 50,10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def demo_run(steps: int, every: int, ranks: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", str(ranks), "--steps", str(steps), "--no-live",
               "--out", out, "--checkpoint-every", str(every)]
        start = time.monotonic()
        subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - start
        summary = json.loads(next(Path(out).glob("*/summary.json")).read_text())
    return wall, summary.get("checkpoints") or {"written": 0, "seconds": 0.0}


def one_save(reps: int) -> tuple[float, float]:
    import torch

    import popmesh
    from popmesh.demo.learner import CartPoleLearner
    from popmesh.population.state.checkpoint import Checkpointer

    popmesh.init("local")
    learner = CartPoleLearner(seed=0)
    learner.iterate()
    agent = learner.checkpoint(1)
    with tempfile.TemporaryDirectory() as tmp:
        saver = Checkpointer(Path(tmp) / "atomic", every=1, keep=2)
        bare, atomic = [], []
        for i in range(reps):
            start = time.perf_counter()
            torch.save(agent.to_dict(), Path(tmp) / "bare.pt")
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            saver.save(i + 1, agent)
            atomic.append(time.perf_counter() - start)
    learner.close()
    return statistics.median(bare), statistics.median(atomic)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40_000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--every", default="50,10", help="checkpoint cadences in iterations")
    p.add_argument("--reps", type=int, default=30, help="saves in part 2")
    args = p.parse_args()
    cadences = [int(x) for x in args.every.split(",")]
    walls: dict[int, list[float]] = {0: [], **{k: [] for k in cadences}}
    spent: dict[int, list[tuple[int, float]]] = {k: [] for k in cadences}
    for _ in range(args.rounds):
        for every in (0, *cadences):
            wall, info = demo_run(args.steps, every, args.ranks)
            walls[every].append(wall)
            if every:
                spent[every].append((info["written"], info["seconds"]))
    none = statistics.median(walls[0])
    print(f"demo, {args.ranks} ranks, {args.steps:,} steps per agent (512 per iteration), {args.rounds} rounds")
    print(f"  no checkpoints: run {none:.1f} s (median)")
    for every in cadences:
        written = statistics.median(n for n, _ in spent[every])
        seconds = statistics.median(s for _, s in spent[every])
        share = seconds / statistics.median(walls[every])
        ratios = [w / n for w, n in zip(walls[every], walls[0])]
        each = 1e3 * seconds / max(written, 1)
        print(f"  every {every:>3} iterations: {written:.0f} checkpoints, {each:.1f} ms each "
              f"(rank 0), {100 * share:.2f} % of the run; run time {statistics.median(ratios):.3f}x no checkpoints "
              f"(paired, range {min(ratios):.3f}-{max(ratios):.3f})")
    bare, atomic = one_save(args.reps)
    print(f"one agent's save (world of one, median of {args.reps}): bare torch.save {1e3 * bare:.2f} ms, "
          f"popmesh atomic {1e3 * atomic:.2f} ms ({atomic / bare:.1f}x: fsync, SHA-256, manifest)")


if __name__ == "__main__":
    main()
