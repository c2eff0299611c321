"""all_reduce through popmesh vs the raw engine call, same process, same run: gloo and MPI, 2 ranks.

Three contenders alternate: the raw engine call, popmesh as it runs by default (with the always-on
mismatch guard, popmesh.comm.guard: a repeated call's guard runs beside its payload), and popmesh's
path without the guard (the previous default: no check at all unless POPMESH_CHECK=1).

Targets (issue #2): popmesh <= 1.1x raw for >= 1 MB; <= raw + 20 us for 4 B.
Targets (issue #19): the guard costs <= 5 % at 4 B on MPI, <= 1 % at 1 MB and up.
Run: .venv/bin/python benchmarks/collectives.py   (the driver launches both worlds itself)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, launch_json, write_result

SIZES = {"4 B": 1, "1 MB": 1 << 18, "16 MB": 1 << 22, "64 MB": 1 << 24}  # float32 elements
REPS = {"4 B": 2000, "1 MB": 100, "16 MB": 12, "64 MB": 4}


def raw_call(engine: str, buf):
    if engine == "torch":
        import torch.distributed as dist

        return lambda: dist.all_reduce(buf)
    from mpi4py import MPI

    return lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def unguarded_call(buf):
    """popmesh's all_reduce_ without the guard: the same setup and engine call as the default path."""
    from popmesh.comm.collectives import _reduce_array, _setup
    from popmesh.comm.reduction import lowering_of
    from popmesh.core.ops import ReduceOp

    def call():
        comm, seconds = _setup(None, None, "all_reduce")
        _reduce_array(buf, ReduceOp.SUM, lowering_of(buf, ReduceOp.SUM), comm, seconds, True)

    return call


def worker() -> None:
    import popmesh

    world = popmesh.init()
    rows = {}
    for label, numel in SIZES.items():
        if world.engine_name == "torch":
            import torch

            buf = torch.ones(numel, dtype=torch.float32)
        else:
            buf = np.ones(numel, dtype=np.float32)
        contenders = {"raw": raw_call(world.engine_name, buf), "popmesh": lambda buf=buf: popmesh.all_reduce_(buf),
                      "unguarded": unguarded_call(buf)}
        times = interleaved(contenders, REPS[label], rounds=5)
        rows[label] = times
    if world.is_main:
        write_result({"engine": world.engine_name, "rows": rows})
    world.finalize()


def main() -> None:
    print(f"{'engine':7} {'size':>6} {'raw':>12} {'popmesh':>12} {'ratio':>7} {'overhead':>10} "
          f"{'unguarded':>12} {'guard cost':>18}")
    for engine in ("torch", "mpi"):
        result = launch_json(os.path.abspath(__file__), 2, engine, "--worker")
        name = "gloo" if engine == "torch" else "mpich"
        for label, t in result["rows"].items():
            raw, ours, old = t["raw"], t["popmesh"], t["unguarded"]
            print(f"{name:7} {label:>6} {raw * 1e6:10.1f}us {ours * 1e6:10.1f}us {ours / raw:6.2f}x "
                  f"{(ours - raw) * 1e6:+8.1f}us {old * 1e6:10.1f}us {(ours / old - 1) * 100:+7.1f}% "
                  f"{(ours - old) * 1e6:+7.1f}us")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
