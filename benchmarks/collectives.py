"""all_reduce through popmesh vs the raw engine call, same process, same run: gloo and MPI, 2 ranks
(``--nproc 2,4,8``: each world size in turn; ``--sizes "4 B,1 MB"``: a subset of the sizes).

Three contenders alternate on one buffer of zeros (summed in place again and again, ones would reach
infinity within 128 calls, a value whose check costs a round; real data stays finite): the raw engine
call, popmesh as it runs by default (with the always-on mismatch check, popmesh.comm.guard: a repeated
call carries its check in its payload), and popmesh's one-array all_reduce_ without the check (``unguarded``:
the same setup and engine call, no check at all unless POPMESH_CHECK=1). ``check`` is popmesh over it.

Targets: popmesh <= 1.1x raw for >= 1 MB; <= raw + 20 us for 4 B; the check costs <= 5 % at 4 B on MPI,
<= 1 % at 1 MB and up.
More ranks than cores (a 2-core box at 4 or more) measure oversubscription as much as the algorithm:
see docs/scaling.md.
Run: .venv/bin/python benchmarks/collectives.py [--nproc 2,4,8] [--sizes "4 B,1 MB"] [--engines torch,mpi] [--swap]
     [--reps-scale F]   (F scales the repetitions: shorter runs at more ranks)
     [--cpu]            (also the check's own CPU time, in one process over an engine that does not communicate)
     [--rounds R]       (rounds of interleaved medians, default 5: more to see a 1 % cost through the box's drift)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, launch_json, reps, threads_line, world_threads, write_result

SIZES = {"4 B": 1, "1 KB": 256, "1 MB": 1 << 18, "16 MB": 1 << 22, "64 MB": 1 << 24}  # float32 elements
DEFAULT_SIZES = "4 B,1 KB,1 MB,16 MB"
REPS = {"4 B": 2000, "1 KB": 2000, "1 MB": 100, "16 MB": 12, "64 MB": 4}


def raw_call(engine: str, buf):
    if engine == "torch":
        import torch.distributed as dist

        return lambda: dist.all_reduce(buf)
    from mpi4py import MPI

    return lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def unguarded_call(buf, group=None):
    """``popmesh.all_reduce_(buf)`` without the check: the same functions, one inside the other, as
    popmesh's one-array path has them, minus the check."""
    from popmesh.comm.collectives import _reduce_array, _setup
    from popmesh.comm.reduction import lowering_of
    from popmesh.core.arrays import is_torch
    from popmesh.core.ops import ReduceOp

    def all_reduce_(x, op="sum", *, group=None, timeout=None):
        return _all_reduce(x, op, group, timeout, in_place=True)

    def _all_reduce(x, op, group, timeout, *, in_place):
        reduce_op = op if type(op) is ReduceOp else ReduceOp.parse(op)
        comm, seconds = _setup(group, timeout, "all_reduce")
        if isinstance(x, np.ndarray) or is_torch(x):
            return _all_reduce_array(x, reduce_op, comm, seconds, in_place)
        raise AssertionError("benchmarked with one array")

    def _all_reduce_array(x, op, comm, seconds, in_place):
        lowering = lowering_of(x, op)
        if comm.size == 1 or comm.check:
            raise AssertionError("benchmarked in a world of two or more, without check mode")
        return _reduce_array(x, op, lowering, comm, seconds, in_place)

    return lambda: all_reduce_(buf, group=group)


def check_cpu_cost(kind: str, rounds: int) -> None:
    """The check's own CPU time, which the engines' drift hides at 1 MB and up: ``popmesh.all_reduce_``
    against the pre-check path in one process, over an engine of two identical ranks that does no
    communication (a SUM doubles the buffer in place, as two equal contributions would)."""
    import popmesh
    from popmesh.comm.world import World
    from popmesh.engines.local import LocalEngine

    class TwoIdleRanks(LocalEngine):
        name = "idle"
        size = 2

        def all_reduce_(self, buf, op, group, timeout):
            if op.value == "sum":
                buf *= 2

        def all_reduce_start(self, buf, op, group):
            self.all_reduce_(buf, op, group, 0.0)
            return super().all_reduce_start(buf, op, group)

    world = World(TwoIdleRanks(), 300.0, False)
    for label in ("4 B", "1 MB"):
        if kind == "torch":
            import torch

            buf = torch.zeros(SIZES[label], dtype=torch.float32)
        else:
            buf = np.zeros(SIZES[label], dtype=np.float32)
        for _ in range(5):
            popmesh.all_reduce_(buf, group=world)
        assert world.history.carried is not None, "the call is predicted and carries its check"
        contenders = {"popmesh": lambda buf=buf: popmesh.all_reduce_(buf, group=world),
                      "unguarded": unguarded_call(buf, group=world)}
        t = interleaved(contenders, reps(20000 if label == "4 B" else 2000), rounds)
        print(f"{'cpu':7} {kind:>5} {label:>6} {'':>12} {t['popmesh'] * 1e6:10.2f}us {'':>7} {'':>10} "
              f"{t['unguarded'] * 1e6:10.2f}us {t['popmesh'] / t['unguarded']:6.3f}x "
              f"{(t['popmesh'] - t['unguarded']) * 1e6:+8.2f}us", flush=True)


def worker() -> None:
    import popmesh

    world = popmesh.init()
    rows = {}
    wanted = os.environ.get("BENCH_SIZES", DEFAULT_SIZES).split(",")
    for label, numel in ((k, v) for k, v in SIZES.items() if k in wanted):
        if world.engine_name == "torch":
            import torch

            buf = torch.zeros(numel, dtype=torch.float32)
        else:
            buf = np.zeros(numel, dtype=np.float32)
        contenders = {"raw": raw_call(world.engine_name, buf), "popmesh": lambda buf=buf: popmesh.all_reduce_(buf),
                      "unguarded": unguarded_call(buf)}
        if os.environ.get("BENCH_ORDER") == "swap":  # the middle place may carry a bias of its own
            contenders = {k: contenders[k] for k in ("raw", "unguarded", "popmesh")}
        times = interleaved(contenders, reps(REPS[label]), rounds=int(os.environ.get("BENCH_ROUNDS", "5")))
        rows[label] = times
    threads = world_threads()
    if world.is_main:
        write_result({"engine": world.engine_name, "rows": rows, "threads": threads})
    world.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2", help="world sizes, comma-separated")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"a subset of {list(SIZES)}")
    parser.add_argument("--engines", default="torch,mpi")
    parser.add_argument("--reps-scale", default="1", help="scale the repetitions (shorter runs at more ranks)")
    parser.add_argument("--swap", action="store_true", help="time the unchecked path between the other two")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of interleaved medians")
    parser.add_argument("--cpu", action="store_true",
                        help="also time the check's own CPU cost in one process (numpy and torch, no engine)")
    opts = parser.parse_args()
    os.environ["BENCH_SIZES"] = opts.sizes
    os.environ["BENCH_ORDER"] = "swap" if opts.swap else "plain"
    os.environ["BENCH_REPS_SCALE"] = opts.reps_scale
    os.environ["BENCH_ROUNDS"] = str(opts.rounds)
    print(f"{'engine':7} {'ranks':>5} {'size':>6} {'raw':>12} {'popmesh':>12} {'ratio':>7} {'overhead':>10} "
          f"{'unguarded':>12} {'check':>7} {'check cost':>10}")
    for engine in opts.engines.split(","):
        for n in [int(x) for x in opts.nproc.split(",")]:
            result = launch_json(os.path.abspath(__file__), n, engine, "--worker")
            name = "gloo" if engine == "torch" else "mpich"
            for label, t in result["rows"].items():
                raw, ours, old = t["raw"], t["popmesh"], t["unguarded"]
                print(f"{name:7} {n:5} {label:>6} {raw * 1e6:10.1f}us {ours * 1e6:10.1f}us {ours / raw:6.2f}x "
                      f"{(ours - raw) * 1e6:+8.1f}us {old * 1e6:10.1f}us {ours / old:6.3f}x "
                      f"{(ours - old) * 1e6:+8.1f}us", flush=True)
            print(f"{name:7} {n:5} {threads_line(result)}", flush=True)
    if opts.cpu:  # each kind in its own process: a signature's form remembers the kind that recorded it
        for kind in ("numpy", "torch"):
            cmd = [sys.executable, os.path.abspath(__file__), "--cpu-worker", kind, str(opts.rounds)]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    elif "--cpu-worker" in sys.argv:
        check_cpu_cost(sys.argv[2], int(sys.argv[3]))
    else:
        main()
