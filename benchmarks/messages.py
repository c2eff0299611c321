"""Point-to-point messages through popmesh vs the raw engine call, same processes, same run: 2 ranks.

Ping-pong between ranks 0 and 1. 64 MB (float32): one-way time = round trip / 2, reported as
throughput; 336 KB (a population policy's weight stream, 84 k float32) and 4 B: round-trip latency.
Contenders: ``raw`` (``dist.send/recv`` on gloo,
``comm.Send/Recv`` on MPI, into preallocated buffers), ``popmesh`` (``popmesh.send/recv``: wire
frame, tags, timeouts, a new receive buffer per message) and ``p2p`` (the engine's frame
transport under it, bytes only). On MPI at 4 B also ``floor``: the same frame and envelope over bare
mpi4py calls (:func:`codec_floor_pingpong`), the least a pure-Python implementation of the wire
format can cost. At 336 KB also ``no CRC``: popmesh with ``checksum=False``, as the population
policies send weights (the payload CRC, on by default up to 1 MiB, costs four passes over the bytes
per round trip).
Targets: popmesh >= 0.9x raw throughput at 64 MB, <= 1.5x raw round trip at 4 B.
Run: .venv/bin/python benchmarks/messages.py   (the driver launches both worlds itself)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, launch_json, write_result

SIZES = {"64 MB": 16 << 20, "336 KB": 84_000, "4 B": 1}  # float32 elements
REPS = {"64 MB": 3, "336 KB": 40, "4 B": 400}
ROUNDS = {"64 MB": 9, "336 KB": 5, "4 B": 5}  # 64 MB: the VM drifts by up to 40 % within a run; nine rounds tame it


def raw_pingpong(engine: str, rank: int, numel: int):
    if engine == "torch":
        import torch
        import torch.distributed as dist

        buf = torch.ones(numel, dtype=torch.float32)
        if rank == 0:
            return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
        return lambda: (dist.recv(buf, 0), dist.send(buf, 0))
    from mpi4py import MPI

    comm, buf = MPI.COMM_WORLD, np.ones(numel, dtype=np.float32)
    if rank == 0:
        return lambda: (comm.Send(buf, 1), comm.Recv(buf, 1))
    return lambda: (comm.Recv(buf, 0), comm.Send(buf, 0))


def popmesh_pingpong(rank: int, numel: int, checksum: bool | None = None):
    import popmesh

    data = np.ones(numel, dtype=np.float32)
    if rank == 0:
        return lambda: (popmesh.send(data, 1, tag=1, checksum=checksum), popmesh.recv(1, tag=1))
    return lambda: popmesh.send(popmesh.recv(0, tag=1)[1], 0, tag=1, checksum=checksum)


def p2p_pingpong(world, rank: int, numel: int):
    p2p = world.engine.p2p()
    data = np.ones(numel, dtype=np.float32).view(np.uint8)
    if rank == 0:
        return lambda: (p2p.send(data, 1, 2, 60), p2p.recv(1, 2, 60))
    return lambda: p2p.send(p2p.recv(0, 2, 60)[1], 0, 2, 60)


def codec_floor_pingpong(rank: int, numel: int):
    """The least Python that moves popmesh's bytes over MPI: the same wire frame and envelope
    (``encode_message``, ``plan_frame``, ``parse_envelope``, ``decode``) over bare mpi4py calls, with
    no group or tag checks, no timeouts, no locks and no matching. What is left over raw is the cost
    of building and checking the frame in Python; popmesh cannot get below it without compiled code."""
    from mpi4py import MPI

    from popmesh.engines.envelope import parse_envelope, plan_frame
    from popmesh.wire import decode, encode_message

    comm, status, other, tag = MPI.COMM_WORLD, MPI.Status(), 1 - rank, 7

    def send(x: np.ndarray) -> None:
        env, _ = plan_frame([np.frombuffer(encode_message(x), np.uint8)], tag)
        comm.Isend(env, dest=other, tag=tag).Wait()

    def recv() -> np.ndarray:
        while (message := comm.Improbe(source=other, tag=tag, status=status)) is None:
            pass
        env = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        message.Recv(env)
        return decode(parse_envelope(env).inline)

    data = np.ones(numel, dtype=np.float32)
    if rank == 0:
        return lambda: (send(data), recv())
    return lambda: send(recv())


def worker() -> None:
    import popmesh

    world = popmesh.init()
    rows = {}
    for label, numel in SIZES.items():
        fns = {"raw": raw_pingpong(world.engine_name, world.rank, numel),
               "popmesh": popmesh_pingpong(world.rank, numel),
               "p2p": p2p_pingpong(world, world.rank, numel)}
        if world.engine_name == "mpi" and label == "4 B":
            fns["floor"] = codec_floor_pingpong(world.rank, numel)
        if label == "336 KB":  # without the payload CRC (default up to 1 MiB), as the population streams
            fns["no CRC"] = popmesh_pingpong(world.rank, numel, checksum=False)
        rows[label] = interleaved(fns, REPS[label], rounds=ROUNDS[label])
        popmesh.barrier()
    if world.is_main:
        write_result({"engine": world.engine_name, "rows": rows})
    popmesh.barrier()
    world.finalize()


def main() -> None:
    print(f"{'engine':7} {'size':>6} {'raw':>14} {'popmesh':>14} {'p2p':>14} {'popmesh/raw':>12} {'extra':>10} "
          f"{'extra/raw':>10}   (extra: 4 B on MPI the pure-Python floor, 336 KB popmesh without payload CRC)")
    for engine in ("torch", "mpi"):
        result = launch_json(os.path.abspath(__file__), 2, engine, "--worker")
        name = "gloo" if engine == "torch" else "mpich"
        for label, t in result["rows"].items():
            if label == "64 MB":
                nbytes = SIZES[label] * 4
                gbps = {k: 2 * nbytes / v / 1e9 for k, v in t.items()}  # two one-way transfers per round trip
                cells = [f"{gbps[k]:9.2f} GB/s" for k in ("raw", "popmesh", "p2p")]
                ratio = f"{t['raw'] / t['popmesh']:.2f}x thr"
            else:
                cells = [f"{t[k] * 1e6:9.1f} us  " for k in ("raw", "popmesh", "p2p")]
                ratio = f"{t['popmesh'] / t['raw']:.2f}x rtt"
            extra = "floor" if "floor" in t else "no CRC" if "no CRC" in t else None
            floor = (f"{t[extra] * 1e6:7.1f} us", f"{t[extra] / t['raw']:.2f}x") if extra else ("-", "-")
            print(f"{name:7} {label:>6} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {ratio:>12} {floor[0]:>10} "
                  f"{floor[1]:>10}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
