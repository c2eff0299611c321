"""The trace timeline's cost: the gradient-sync benchmark's training step with tracing off vs on, and a
popmesh tree without tracing, in one benchmark run.

Model and step as benchmarks/grad_sync.py (100 Linear(316, 316) layers, 40 MB of gradients; zero_grad,
forward, backward, GradientSync(overlap=True), SGD step), 2 ranks on gloo, plus a small all_reduce
(8 bytes: latency-bound, the worst case for a per-call cost). In one world, rounds alternate tracing off
and on (``world.start_trace`` / ``stop_trace``), the order reversed every other round, median of
per-round medians. The tree without tracing (``--before SRC``: a popmesh source tree from before tracing
was added) runs as its own worlds, alternated with this tree's, in the same run.

Run: .venv/bin/python benchmarks/trace_overhead.py [--before /path/to/old/src] [--pairs 3]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, median_time, write_result
from grad_sync import BATCH, WIDTH, build_model

ROUNDS = int(os.environ.get("TRACE_ROUNDS", "9"))
STEPS = int(os.environ.get("TRACE_STEPS", "10"))
SMALL = int(os.environ.get("TRACE_SMALL", "300"))


def _median_each(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, started together on every rank."""
    import popmesh

    popmesh.barrier()
    return median_time(fn, reps, warmup=0)


def worker() -> None:
    import numpy as np
    import torch

    import popmesh
    from popmesh.torch import GradientSync

    torch.set_num_threads(1)
    world = popmesh.init()
    model = build_model()
    sync = GradientSync(model, overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    small = np.ones(1, np.float64)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        sync()
        opt.step()

    def tiny() -> None:
        popmesh.all_reduce_(small)

    for _ in range(3):
        step()
    can_trace = hasattr(world, "start_trace")
    modes = ["off", "on"] if can_trace else ["off"]
    samples: dict[str, list[float]] = {f"{k} {m}": [] for k in ("step", "all_reduce 8 B") for m in modes}
    spans_per_step = 0.0
    with tempfile.TemporaryDirectory() as folder:
        for r in range(ROUNDS):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                if mode == "on":
                    world.start_trace(folder)
                samples[f"step {mode}"].append(_median_each(step, STEPS))
                samples[f"all_reduce 8 B {mode}"].append(_median_each(tiny, SMALL))
                if mode == "on":
                    from popmesh.core import trace

                    assert trace.ACTIVE is not None
                    spans_per_step = sum(1 for s in trace.ACTIVE.spans if s[1] != "timer") / (STEPS + SMALL + 2)
                    world.stop_trace(merge=False)
    if world.is_main:
        write_result({"rows": {k: statistics.median(v) for k, v in samples.items()}, "spans": spans_per_step})
    world.finalize()


def main() -> None:
    before = sys.argv[sys.argv.index("--before") + 1] if "--before" in sys.argv else None
    pairs = int(sys.argv[sys.argv.index("--pairs") + 1]) if "--pairs" in sys.argv else 3
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    trees = {"this tree": here, **({"before": before} if before else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for p in range(pairs):
        for name, src in trees.items() if p % 2 == 0 else reversed(trees.items()):
            old = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = src + (os.pathsep + old if old else "")
            try:
                runs[name].append(launch_json(os.path.abspath(__file__), 2, "torch", "--worker", timeout=900))
            finally:
                os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    rows = {f"{label} ({name})": statistics.median(r["rows"][label] for r in results)
            for name, results in runs.items() for label in results[0]["rows"]}
    print(f"2 ranks, gloo; median of {pairs} worlds per tree, each the median of {ROUNDS} rounds")
    for label, t in rows.items():
        print(f"{label:34} {t * 1e3:9.3f} ms")
    for kind in ("step", "all_reduce 8 B"):
        off, on = rows[f"{kind} off (this tree)"], rows[f"{kind} on (this tree)"]
        line = f"{kind}: on / off {on / off:.4f}"
        if before:
            line += f", off / before {off / rows[f'{kind} off (before)']:.4f}"
        print(line)
    print(f"spans per call while tracing: {statistics.median(r['spans'] for r in runs['this tree']):.2f}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
