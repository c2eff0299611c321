"""Gradient averaging: popmesh's bucketed sync vs what the seed libraries do, vs the engine's floor.

Model: 100 Linear(316, 316) layers = 200 parameter tensors, 10.0 M float32 elements (40 MB).
2 ranks, gloo (torch) and MPICH (mpi), each in one run, contenders interleaved (medians of rounds):

  popmesh        popmesh.torch.mean_grads_(model): cached GradientSync, gradients are bucket views
  per-tensor     one raw all-reduce per gradient, then divide (OmniSafe's avg_grads, torchgfn's
                 average_gradients)
  flatten        torch.cat the gradients, one raw all-reduce, divide, copy back
  flat floor     one raw all-reduce of an already-flat 40 MB buffer (the engine's floor)

and a full training step (zero_grad, forward, backward, sync, SGD step): on gloo, GradientSync
against torch DDP (also both at their best: gradients kept between steps, `zero_grad(set_to_none=False)`,
so autograd accumulates into GradientSync's bucket views and DDP's `gradient_as_bucket_view=True`
buckets); on MPI, GradientSync over MPICH (shared memory on one box) against torch DDP over a gloo
process group that the same MPI ranks open beside it, so both run in one world, interleaved (a path
DDP cannot take without an MPI-built torch). Each step is also timed by phase (forward,
backward, sync wait, optimizer). Goal: popmesh-on-MPI step throughput >= 1.5x DDP-on-gloo on 2
ranks. ``--sweep`` also times GradientSync at several caps, and the raw engine on the 40 MB in
pieces, one call after another vs all queued at once (the measurements behind each engine adapter's
``tuning``: bucket cap and reductions in flight).

Run: .venv/bin/python benchmarks/grad_sync.py [--sweep] [--ranks N]   (the driver launches both worlds;
     $GRAD_SYNC_ROUNDS sets the rounds, default 21)
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, launch_json, threads_line, world_threads, write_result

LAYERS, WIDTH, BATCH = 100, 316, 16
SWEEP_CAPS = (256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 25 << 20, 64 << 20)
PIECES = (1 << 20, 4 << 20, 16 << 20)
ROUNDS = int(os.environ.get("GRAD_SYNC_ROUNDS", "21"))


def interleave(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per contender, one call of each per round, the order reversed every other
    round, so that drift and a noisy neighbour hit every contender alike. A barrier before each
    call lines the ranks up, so a call's time is its own, not the previous call's skew."""
    import popmesh

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in items if r % 2 == 0 else items[::-1]:
            popmesh.barrier()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def build_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def fill_grads(model, rank: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(rank + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def raw_all_reduce(engine: str):
    """The engine's own in-place SUM, bypassing popmesh."""
    if engine == "torch":
        import torch.distributed as dist

        return lambda t: dist.all_reduce(t)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)


def sync_contenders(world, model, flat):
    import torch

    from popmesh.torch import mean_grads_

    reduce_, n = raw_all_reduce(world.engine_name), world.size
    grads = [p.grad for p in model.parameters()]

    def per_tensor() -> None:
        for g in grads:
            reduce_(g)
            g.div_(n)

    def flatten() -> None:
        buf = torch.cat([g.reshape(-1) for g in grads])
        reduce_(buf)
        buf.div_(n)
        offset = 0
        for g in grads:
            g.copy_(buf[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    mean_grads_(model)  # build the cached sync; from here the gradients are its bucket views
    grads[:] = [p.grad for p in model.parameters()]
    return {"popmesh": lambda: mean_grads_(model), "per-tensor": per_tensor, "flatten": flatten,
            "flat floor": lambda: reduce_(flat)}


def sweep_contenders(world, rank: int):
    from popmesh.torch import GradientSync

    fns = {}
    for cap in SWEEP_CAPS:
        model = build_model()
        fill_grads(model, rank)
        sync = GradientSync(model, cap_bytes=cap, overlap=False)
        fns[f"cap {cap >> 10} KiB"] = sync
    return fns


def raw_start(engine: str):
    """The engine's own non-blocking in-place SUM; returns a function that waits for it."""
    if engine == "torch":
        import torch.distributed as dist

        return lambda t: dist.all_reduce(t, async_op=True).wait
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return lambda t: comm.Iallreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM).Wait


def pieces_contenders(world, flat):
    """The raw engine on the same 40 MB in pieces: blocking one by one vs all queued at once."""
    reduce_, start = raw_all_reduce(world.engine_name), raw_start(world.engine_name)
    fns = {}
    for cap in PIECES:
        parts = list(flat.split(cap // 4))

        def one_by_one(parts=parts) -> None:
            for t in parts:
                reduce_(t)

        def queued(parts=parts) -> None:
            for wait in [start(t) for t in parts]:
                wait()

        fns[f"raw {cap >> 20} MiB pieces, one by one"] = one_by_one
        fns[f"raw {cap >> 20} MiB pieces, all queued"] = queued
    return fns


def step_contenders(world):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from popmesh.torch import GradientSync

    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))

    def make_step(model, sync=None, set_to_none=True):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=set_to_none)
            model(x).pow(2).mean().backward()
            if sync is not None:
                sync()
            opt.step()

        return step

    ours = build_model()
    fns = {"step popmesh overlap": make_step(ours, GradientSync(ours, overlap=True))}
    plain = build_model()
    fns["step popmesh no-overlap"] = make_step(plain, GradientSync(plain, overlap=False))
    if world.engine_name == "mpi":
        _gloo_beside_mpi(world)
    fns["step DDP"] = make_step(DistributedDataParallel(build_model()))
    # Each at its best: gradients kept between steps (zero_grad(set_to_none=False)), so autograd
    # accumulates straight into GradientSync's bucket views / DDP's buckets (gradient_as_bucket_view).
    kept = build_model()
    fns["step popmesh overlap, kept"] = make_step(kept, GradientSync(kept, overlap=True), set_to_none=False)
    fns["step DDP, bucket view, kept"] = make_step(DistributedDataParallel(build_model(), gradient_as_bucket_view=True),
                                                   set_to_none=False)
    fns["step compute only"] = make_step(build_model())
    return fns


def _gloo_beside_mpi(world) -> None:
    """Open torch's default gloo process group in the MPI world's own processes, for DDP."""
    import torch.distributed as dist

    import popmesh

    port = popmesh.broadcast_object(free_port() if world.rank == 0 else None, src=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)


def phase_breakdown(world, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds per phase of one training step: forward, backward, sync wait, optimizer.

    For DDP the sync happens inside backward (its hooks) and at its end, so its backward includes
    the sync and its sync wait is 0; GradientSync(overlap=True) starts buckets in backward too and
    its sync wait is what ``sync()`` still waits for after backward."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import popmesh
    from popmesh.torch import GradientSync

    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    ours = build_model()
    setups = {"popmesh overlap": (ours, GradientSync(ours, overlap=True)),
              "DDP": (DistributedDataParallel(build_model()), None)}
    out: dict[str, dict[str, float]] = {}
    for name, (model, sync) in setups.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        samples: dict[str, list[float]] = {"forward": [], "backward": [], "sync wait": [], "optimizer": []}
        for r in range(rounds + 2):
            popmesh.barrier()
            opt.zero_grad()
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if sync is not None:
                sync()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            if r >= 2:
                for key, value in zip(samples, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    samples[key].append(value)
        out[name] = {key: statistics.median(values) for key, values in samples.items()}
    return out



def worker() -> None:
    import torch

    import popmesh

    torch.set_num_threads(1)
    world = popmesh.init()
    model = build_model()
    fill_grads(model, world.rank)
    flat = torch.ones(sum(p.numel() for p in model.parameters()))
    contenders = sync_contenders(world, model, flat)
    if "--sweep" in sys.argv:  # in the same rounds, so that every ratio compares like with like
        contenders.update(sweep_contenders(world, world.rank))
        contenders.update(pieces_contenders(world, flat))
    rows = interleave(contenders, rounds=ROUNDS)
    rows.update(interleave(step_contenders(world), rounds=ROUNDS))
    phases = phase_breakdown(world, ROUNDS)
    threads = world_threads()  # DDP's and GradientSync's threads are all alive here
    if world.is_main:
        write_result({"engine": world.engine_name, "rows": rows, "phases": phases, "threads": threads,
                      "ranks": world.size,
                      "params": sum(1 for _ in model.parameters()), "numel": flat.numel()})
    if world.engine_name == "mpi":
        import torch.distributed as dist

        dist.destroy_process_group()
    world.finalize()


def _spawn_json(n: int, engine: str, args: list[str]) -> dict:
    """Start a world the way tests/world/harness.py does (for when `popmesh launch` is absent)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, BENCH_OUT=str(out), OMP_NUM_THREADS="1", POPMESH_ENGINE=engine)
        cmd = [sys.executable, os.path.abspath(__file__), *args]
        if engine == "mpi":
            exe = Path(sys.executable).with_name("mpiexec")
            subprocess.run([str(exe), "-n", str(n), *cmd], env=env, check=True, timeout=900)
        else:
            port = str(free_port())
            procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                                                    LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                                                    MASTER_PORT=port)) for r in range(n)]
            codes = [p.wait(timeout=900) for p in procs]
            if any(codes):
                raise RuntimeError(f"benchmark ranks exited with {codes}")
        return json.loads(out.read_text())


def run_world(engine: str, args: list[str], ranks: int = 2) -> dict:
    if importlib.util.find_spec("popmesh.launch.cli") is not None:
        return launch_json(os.path.abspath(__file__), ranks, engine, *args, timeout=900)
    return _spawn_json(ranks, engine, args)


def report(result: dict) -> None:
    name = "gloo" if result["engine"] == "torch" else "mpich"
    rows = result["rows"]
    floor, per_tensor = rows["flat floor"], rows["per-tensor"]
    ranks = result.get("ranks", 2)
    print(f"\n{name}: {result['params']} tensors, {result['numel'] / 1e6:.1f} M float32, {ranks} ranks")
    print(f"{'contender':26} {'median':>10} {'/ floor':>8} {'/ per-tensor':>13}")
    for label, t in rows.items():
        if label.startswith("step"):
            continue
        print(f"{label:26} {t * 1e3:8.2f}ms {t / floor:7.2f}x {t / per_tensor:12.3f}x")
    if "step DDP" in rows:
        ddp = rows["step DDP"]
        engine = "MPICH" if result["engine"] == "mpi" else "gloo"
        print(f"\n{'training step':26} {'median':>10} {'/ DDP':>8} {'throughput / DDP':>17}"
              f"   (popmesh on {engine}, DDP on gloo)")
        for label, t in rows.items():
            if label.startswith("step"):
                print(f"{label[5:]:26} {t * 1e3:8.2f}ms {t / ddp:7.3f}x {ddp / t:16.2f}x")
        if "step DDP, bucket view, kept" in rows:  # each contender at its faster setting of the two
            ours = min(rows["step popmesh overlap"], rows["step popmesh overlap, kept"])
            theirs = min(rows["step DDP"], rows["step DDP, bucket view, kept"])
            print(f"{'each at its best':26} {ours * 1e3:8.2f}ms vs DDP {theirs * 1e3:.2f}ms: throughput "
                  f"{theirs / ours:.2f}x")
    phases = result.get("phases", {})
    if phases:
        print(f"\n{'step phases (median)':26} " + " ".join(f"{k:>11}" for k in next(iter(phases.values()))))
        for label, parts in phases.items():
            print(f"{label:26} " + " ".join(f"{v * 1e3:9.2f}ms" for v in parts.values()))
    if "threads" in result:
        print(f"\n{threads_line(result)}")


def main() -> None:
    args = ["--worker"] + (["--sweep"] if "--sweep" in sys.argv else [])  # --only-torch / --only-mpi: one world
    engines = [e for e in ("torch", "mpi") if f"--only-{'mpi' if e == 'torch' else 'torch'}" not in sys.argv]
    ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
    for engine in engines:
        report(run_world(engine, args, ranks))


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
