"""Point-to-point messages: popmesh vs the raw engine call vs what users write today; 2 ranks, same run.

Ping-pong between ranks 0 and 1 (``--ranks N``, N even: N/2 pairs ping-pong at once, rank 2k with
2k + 1; the figures are pair 0's, measured while the other pairs run; ``--reps-scale F`` scales the
repetitions). 64 MB (float32): one-way time = round trip / 2, reported as
throughput; 336 KB (a population policy's weight stream, 84 k float32) and 4 B: round-trip latency.
Contenders, alternating in the same processes:

* ``raw``: ``dist.send/recv`` (gloo) or ``comm.Send/Recv`` (MPI) into preallocated buffers;
* ``users``: what programs write without popmesh: on MPI mpi4py's pickle ``comm.send/recv`` of the
  numpy array; on gloo torchgfn's protocol (``dist.send`` of a length tensor, then the
  ``pickle.dumps`` bytes as a uint8 tensor; the receiver allocates from the length and unpickles);
* ``popmesh``: ``popmesh.send/recv`` (wire frame, tags, timeouts, integrity checks);
* ``p2p``: the engine's frame transport under it, bytes only (no codec);
* ``py path`` (MPI): ``popmesh`` with the transport's C path switched off, as where it is not built.

Goals, printed per row: popmesh <= 1.0x users everywhere; MPI 4 B <= 0.5x users;
gloo 4 B <= 2.0x raw; 336 KB <= 1.5x raw; 64 MB >= 0.95x raw throughput.
Run: .venv/bin/python benchmarks/messages.py [torch|mpi] [--ranks N] [--reps-scale F]
     (the driver launches the worlds itself; default both engines, 2 ranks)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, launch_json, on_python_path, reps, threads_line, world_threads, write_result

SIZES = {"64 MB": 16 << 20, "336 KB": 84_000, "4 B": 1}  # float32 elements
REPS = {"64 MB": 3, "336 KB": 40, "4 B": 400}
ROUNDS = {"64 MB": 9, "336 KB": 5, "4 B": 5}  # 64 MB: the VM drifts by up to 40 % within a run; nine rounds tame it


def raw_pingpong(engine: str, rank: int, numel: int):
    other = rank ^ 1  # the pair: 0 with 1, 2 with 3, ...
    if engine == "torch":
        import torch
        import torch.distributed as dist

        buf = torch.ones(numel, dtype=torch.float32)
        if rank % 2 == 0:
            return lambda: (dist.send(buf, other), dist.recv(buf, other))
        return lambda: (dist.recv(buf, other), dist.send(buf, other))
    from mpi4py import MPI

    comm, buf = MPI.COMM_WORLD, np.ones(numel, dtype=np.float32)
    if rank % 2 == 0:
        return lambda: (comm.Send(buf, other), comm.Recv(buf, other))
    return lambda: (comm.Recv(buf, other), comm.Send(buf, other))


def users_pingpong(engine: str, rank: int, numel: int):
    """What programs write without popmesh: mpi4py's pickle send/recv on MPI, torchgfn's protocol on gloo
    (a length tensor, then the pickled bytes as a uint8 tensor; the receiver allocates from the length)."""
    data = np.ones(numel, dtype=np.float32)
    other = rank ^ 1
    if engine == "torch":
        import pickle

        import torch
        import torch.distributed as dist

        def send(x: object) -> None:
            raw = torch.frombuffer(bytearray(pickle.dumps(x)), dtype=torch.uint8)
            dist.send(torch.tensor([raw.numel()], dtype=torch.long), other)
            dist.send(raw, other)

        def recv() -> object:
            length = torch.zeros(1, dtype=torch.long)
            dist.recv(length, other)
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.recv(buf, other)
            return pickle.loads(buf.numpy().tobytes())
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

        def send(x: object) -> None:
            comm.send(x, dest=other, tag=3)

        def recv() -> object:
            return comm.recv(source=other, tag=3)

    if rank % 2 == 0:
        return lambda: (send(data), recv())
    return lambda: send(recv())


def popmesh_pingpong(rank: int, numel: int):
    import popmesh

    data, other = np.ones(numel, dtype=np.float32), rank ^ 1
    if rank % 2 == 0:
        return lambda: (popmesh.send(data, other, tag=1), popmesh.recv(other, tag=1))
    return lambda: popmesh.send(popmesh.recv(other, tag=1)[1], other, tag=1)


def p2p_pingpong(world, rank: int, numel: int):
    p2p = world.engine.p2p()
    data, other = np.ones(numel, dtype=np.float32).view(np.uint8), rank ^ 1
    if rank % 2 == 0:
        return lambda: (p2p.send(data, other, 2, 60), p2p.recv(other, 2, 60))
    return lambda: p2p.send(p2p.recv(other, 2, 60)[1], other, 2, 60)


def worker() -> None:
    import popmesh

    world = popmesh.init()
    rows = {}
    for label, numel in SIZES.items():
        fns = {"raw": raw_pingpong(world.engine_name, world.rank, numel),
               "users": users_pingpong(world.engine_name, world.rank, numel),
               "popmesh": popmesh_pingpong(world.rank, numel),
               "p2p": p2p_pingpong(world, world.rank, numel)}
        if world.engine_name == "mpi" and world.engine.p2p()._native is not None:
            fns["py path"] = on_python_path(world.engine.p2p(), popmesh_pingpong(world.rank, numel))
        rows[label] = interleaved(fns, reps(REPS[label]), rounds=ROUNDS[label])
        popmesh.barrier()
    threads = world_threads()
    if world.is_main:
        write_result({"engine": world.engine_name, "rows": rows, "threads": threads})
    popmesh.barrier()
    world.finalize()


def goals(engine: str, label: str, t: dict[str, float]) -> list[tuple[str, float, float]]:
    """(what, measured, limit) for every goal that applies to this row: time ratios must
    be at most the limit, except the 64 MB throughput ratio (``thr``), which must be at least it."""
    rows = [("popmesh/users", t["popmesh"] / t["users"], 0.5 if (engine, label) == ("mpi", "4 B") else 1.0)]
    if label == "64 MB":
        rows.append(("thr popmesh/raw", t["raw"] / t["popmesh"], 0.95))
    elif label == "336 KB":
        rows.append(("popmesh/raw", t["popmesh"] / t["raw"], 1.5))
    elif engine == "torch":
        rows.append(("popmesh/raw", t["popmesh"] / t["raw"], 2.0))
    else:
        rows.append(("popmesh/raw", t["popmesh"] / t["raw"], float("inf")))
    return rows


def main() -> None:
    print(f"{'engine':7} {'size':>6} {'raw':>14} {'users':>14} {'popmesh':>14} {'p2p':>14} {'py path':>14} "
          f"{'popmesh/raw':>12} {'popmesh/users':>14}   goals")
    engines = [a for a in sys.argv[1:] if a in ("torch", "mpi")] or ["torch", "mpi"]
    ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
    if ranks < 2 or ranks % 2:
        sys.exit(f"--ranks must be even and at least 2 (pairs ping-pong at once); got {ranks}")
    if "--reps-scale" in sys.argv:
        os.environ["BENCH_REPS_SCALE"] = sys.argv[sys.argv.index("--reps-scale") + 1]
    for engine in engines:
        result = launch_json(os.path.abspath(__file__), ranks, engine, "--worker")
        name = "gloo" if engine == "torch" else "mpich"
        for label, t in result["rows"].items():
            names = ("raw", "users", "popmesh", "p2p", "py path")
            if label == "64 MB":
                nbytes = SIZES[label] * 4  # two one-way transfers a round trip
                cells = [f"{2 * nbytes / t[k] / 1e9:9.2f} GB/s" if k in t else "-" for k in names]
            else:
                cells = [f"{t[k] * 1e6:9.1f} us  " if k in t else "-" for k in names]
            checks = []
            for what, value, limit in goals(engine, label, t):
                if limit == float("inf"):
                    continue
                met = value >= limit if what.startswith("thr") else value <= limit
                checks.append(f"{what} {value:.2f}x {'>=' if what.startswith('thr') else '<='} {limit}: "
                              f"{'met' if met else 'MISSED'}")
            print(f"{name:7} {label:>6} {' '.join(f'{c:>14}' for c in cells)} {t['popmesh'] / t['raw']:>11.2f}x "
                  f"{t['popmesh'] / t['users']:>13.2f}x   {'; '.join(checks)}")
        print(f"{name:7} {ranks} ranks ({ranks // 2} pair{'s' if ranks > 2 else ''} at once); {threads_line(result)}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
