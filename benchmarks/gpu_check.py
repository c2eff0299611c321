"""The prepared device check: popmesh's CUDA paths on a GPU machine, one command, exit non-zero on any wrong value.

    PYTHONPATH=src python3 benchmarks/gpu_check.py          # on a machine with CUDA (about 2-3 minutes)
    python benchmarks/gpu_check.py --cpu                    # the same checks on CPU tensors over gloo

Each part runs in its own world under ``popmesh launch`` and prints what it compared:

* ``collectives``: all_reduce of every op (sum, avg, max, min, prod) and dtype (float32, float64,
  float16, bfloat16, int32, int64, uint8), in place and out of place, plus broadcast and all_gather,
  against the closed-form result computed on the CPU (rank r contributes r + 1). On CUDA the world
  forms with popmesh's default backend, ``cpu:gloo,cuda:nccl``; nccl takes one GPU per rank, so the
  world has as many ranks as GPUs (up to 2), and a one-GPU machine checks nccl on a world of one.
* ``grad_sync``: GradientSync against torch DDP on the same model and batches: the same gradients
  after a step, and the step-time ratio, interleaved.
* ``population``: AverageAll, SelectiveAveraging and AsyncSelectiveAveraging on models on the device:
  the weights after the exchange equal the closed form (2 ranks; on one GPU they share it over gloo,
  which stages CUDA tensors through the host).
* ``gfn``: the torchgfn facade on this host: ``initialize_distributed_compute("gloo", ...)`` gives a
  pure gloo default group (torchgfn's buffers insist on it), and a device tensor crosses send/recv.
* ``jax_fsdp``: FSDP (``popmesh.jax``) on this host's JAX devices: one adamw step gives the same loss
  and parameters as plain data parallelism.

* ``survival``: a lost rank on the device's backend (nccl where there is a GPU per rank): under
  ``popmesh launch --max-restarts 1`` rank 1's first process SIGKILLs itself between all-reduces of a
  device tensor; the survivor catches the PeerFailure, re-forms the world (``world.reform()``, which
  makes the backend's communicators anew) and hands the restarted process the model and the step
  (``hand_over``); after it, every all-reduce is right and both ranks hold the same weights.

``--only PART[,PART]`` runs some parts. Figures go to docs/performance.md with the device's name.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, write_result

PARTS = ("collectives", "grad_sync", "population", "gfn", "survival", "jax_fsdp")
SURVIVAL_STEPS, SURVIVAL_KILL_AT = 12, 5
OPS = ("sum", "avg", "max", "min", "prod")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}  # relative; exact for the rest


def device(cpu: bool):
    import torch

    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def expected(op: str, n: int, base):
    """The closed form of reducing ``base * (r + 1)`` over ranks r < n, in float64 on the CPU."""
    import torch

    values = [base.double() * (r + 1) for r in range(n)]
    stacked = torch.stack(values)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "max":
        return stacked.max(0).values
    if op == "min":
        return stacked.min(0).values
    return stacked.prod(0)


def check_collectives(world, dev) -> list[str]:
    import torch

    import popmesh

    wrong, n = [], world.size
    for name in DTYPES:
        dtype = getattr(torch, name)
        base = torch.arange(1, 7, dtype=torch.float64).reshape(2, 3) % 3 + 1  # small values: no overflow
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue  # an average of integers is not an integer: popmesh refuses it
            want = expected(op, n, base)
            for in_place in (True, False):
                mine = (base * (world.rank + 1)).to(dtype).to(dev)
                got = popmesh.all_reduce_(mine, op) if in_place else popmesh.all_reduce(mine, op)
                if got.device != dev or got.dtype != dtype:
                    wrong.append(f"all_reduce {op} {name}: came back {got.dtype} on {got.device}")
                    continue
                tolerance = TOLERANCE.get(name, 0.0)
                error = (got.double().cpu() - want.to(dtype).double()).abs().max().item()
                if error > tolerance * want.abs().max().item():
                    wrong.append(f"all_reduce{'_' if in_place else ''} {op} {name}: off by {error}")
        value = torch.full((4,), float(world.rank + 1), device=dev).to(dtype)
        popmesh.broadcast_(value, src=n - 1)
        if value.device != dev or int(value[0].item()) != n:
            wrong.append(f"broadcast_ {name}: {value.tolist()} on {value.device}")
        gathered = popmesh.all_gather(torch.full((2,), world.rank + 1, device=dev).to(dtype))
        if [int(g[0].item()) for g in gathered] != list(range(1, n + 1)):
            wrong.append(f"all_gather {name}: {[g.tolist() for g in gathered]}")
    return wrong


def check_grad_sync(world, dev) -> tuple[list[str], dict[str, float]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import popmesh
    from popmesh.torch import GradientSync, broadcast_params_

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(dev)  # noqa: E731
    ours, theirs = make(), make()
    theirs.load_state_dict(ours.state_dict())
    broadcast_params_(ours, src=0)
    broadcast_params_(theirs, src=0)
    sync = GradientSync(ours)
    ddp = DDP(theirs, device_ids=[dev.index] if dev.type == "cuda" else None)
    batch = torch.randn(64, 256, device=dev, generator=None) * (world.rank + 1)

    def ours_step() -> None:
        ours.zero_grad()
        ours(batch).square().mean().backward()
        sync()

    def ddp_step() -> None:
        ddp.zero_grad()
        ddp(batch).square().mean().backward()

    ours_step(), ddp_step()
    wrong = [f"GradientSync and DDP gradients differ on {name}"
             for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters())
             if not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)]
    times: dict[str, list[float]] = {"popmesh": [], "ddp": []}
    for _ in range(20):
        for label, step in (("popmesh", ours_step), ("ddp", ddp_step)):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times[label].append(time.perf_counter() - start)
    popmesh.barrier()
    medians = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return wrong, {"step_popmesh_s": medians["popmesh"], "step_ddp_s": medians["ddp"],
                   "popmesh_over_ddp": medians["popmesh"] / medians["ddp"]}


def check_population(world, dev) -> list[str]:
    import torch

    from popmesh.population import AsyncSelectiveAveraging, AverageAll, ReplacementRule, SelectiveAveraging

    wrong = []

    def agent(value: float):
        model = torch.nn.Linear(4, 3).to(dev)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = agent(world.rank + 1.0)
    model, opt, _ = AverageAll(1)(1, model, opt, float(world.rank))
    mean = (world.size + 1) / 2
    if any(p.device != dev or not torch.allclose(p, torch.full_like(p, mean)) for p in model.parameters()):
        wrong.append(f"AverageAll: rank {world.rank} holds {[p.flatten()[0].item() for p in model.parameters()]}")
    model, opt = agent(world.rank + 1.0)
    model, opt, info = SelectiveAveraging(1, rule=ReplacementRule(ratio=0.5))(1, model, opt, float(world.rank))
    best = float(world.size)  # the best agent (highest metric: the last rank) holds world.size
    if world.rank == 0 and world.size > 1 and not all(torch.allclose(p, torch.full_like(p, best))
                                                      for p in model.parameters()):
        wrong.append(f"SelectiveAveraging: the replaced rank 0 holds {next(model.parameters()).flatten()[0]}")
    model, opt = agent(world.rank + 1.0)
    policy = AsyncSelectiveAveraging(1, rule=ReplacementRule(ratio=0.5))
    deadline = time.monotonic() + 60
    iteration = 0
    while time.monotonic() < deadline:
        iteration += 1
        model, opt, info = policy(iteration, model, opt, float(world.rank))
        if world.rank != 0 or world.size == 1 or info.replaced:
            break
        time.sleep(0.01)
    policy.shutdown()
    if world.rank == 0 and world.size > 1:
        values = {round(p.flatten()[0].item(), 4) for p in model.parameters()}
        if values != {best} or next(model.parameters()).device != dev:
            wrong.append(f"AsyncSelectiveAveraging: the replaced rank 0 holds {values} on "
                         f"{next(model.parameters()).device}")
    return wrong


def check_survival(world, dev) -> tuple[list[str], dict[str, float]]:
    """Rank 1's first process dies at step SURVIVAL_KILL_AT; the launcher restarts it and the survivor
    re-forms the world and hands it the model and the step. Each step all-reduces a device tensor (rank
    r gives r + 1) and takes one SGD step on the sum, so the weights depend on every step."""
    import signal

    import torch

    import popmesh
    from popmesh.torch import hand_over

    first_life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    model = torch.nn.Linear(4, 3).to(dev)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    wrong: list[str] = []
    step, lost_at, recovered_s = 0, None, 0.0
    if world.newcomers:  # the restarted process: take the survivor's model and step
        step = hand_over(model, None, None, timeout=120)
    while step < SURVIVAL_STEPS:
        if world.rank == 1 and first_life and step == SURVIVAL_KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            total = popmesh.all_reduce(torch.full((1024,), world.rank + 1.0, device=dev), timeout=120)
        except popmesh.PeerFailure:
            lost_at, started = step, time.perf_counter()
            world.reform(timeout=120)
            step = hand_over(model, None, step, timeout=120)
            recovered_s = time.perf_counter() - started
            continue
        want = world.size * (world.size + 1) / 2
        if total.device != dev or not torch.all(total == want):
            wrong.append(f"rank {world.rank} step {step}: all_reduce gave {total[0].item()} on {total.device}, "
                         f"want {want} on {dev}")
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * total[0] * p)
        step += 1
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    everyone = popmesh.all_gather_object(weights.tolist())
    if any(w != everyone[0] for w in everyone):
        wrong.append("the ranks end with different weights")
    if world.rank == 0 and lost_at is None:
        wrong.append("rank 0 never saw rank 1's loss")
    return wrong, {"lost_at_step": -1 if lost_at is None else lost_at, "reform_and_hand_over_s": recovered_s}


def check_gfn(world, dev) -> list[str]:
    import torch
    import torch.distributed as dist

    from popmesh.compat import gfn

    wrong = [] if dist.get_backend() == "gloo" else [f"the facade's default group runs {dist.get_backend()!r}"]
    if world.size > 1:
        payload = torch.arange(6, dtype=torch.float32, device=dev)
        if world.rank == 0:
            gfn.send(payload, dst_rank=1, backend="torch", tag=3)
        elif world.rank == 1:
            _, data = gfn.recv(backend="torch", tag=3)
            if bytes(data.cpu().numpy()) != bytes(payload.cpu().numpy()):
                wrong.append("a device tensor's bytes changed through the facade's send/recv")
    return wrong


def check_jax_fsdp() -> tuple[list[str], dict[str, float]]:
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax
    from popmesh.jax import make_update, pmean, shard_module, sharded_init

    devices = jax.devices()
    count = len(devices)

    class MLP(nn.Module):
        shard: bool = False

        @nn.compact
        def __call__(self, x):
            dense = shard_module(nn.Dense, "fsdp", min_weight_size=128) if self.shard else nn.Dense
            return dense(8, name="out")(nn.relu(dense(64 * count, name="hidden")(x)))

    def train(model, params, specs, x, y):
        optimizer = optax.adamw(0.01, weight_decay=0.1)
        update = make_update(lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2), optimizer,
                             dp_axis_name="fsdp")

        def body(params, x, y):
            opt_state = optimizer.init(params)
            for _ in range(3):
                loss, params, opt_state = update(opt_state, params, x, y)
            return pmean(loss, "fsdp"), params

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")),
                                     out_specs=(P(), specs)))(params, x, y)

    def unbox(tree):
        return jax.tree.map(lambda leaf: leaf.value if isinstance(leaf, nn.Partitioned) else leaf, tree,
                            is_leaf=lambda leaf: isinstance(leaf, nn.Partitioned))

    mesh = Mesh(np.array(devices), ("fsdp",))
    x = jax.random.normal(jax.random.key(1), (8 * count, 16))
    y = jnp.sin(x[:, :8])
    sharded = MLP(shard=True)
    params, specs = sharded_init(lambda k, x: sharded.init(k, x)["params"], mesh, (P(), P("fsdp")),
                                 jax.random.key(0), x)
    fsdp_loss, fsdp_params = train(sharded, params, specs, x, y)
    dp_loss, dp_params = train(MLP(), unbox(params), P(), x, y)
    wrong = []
    if not np.allclose(fsdp_loss, dp_loss, rtol=1e-5):
        wrong.append(f"FSDP loss {float(fsdp_loss)} against data parallelism's {float(dp_loss)}")
    for got, want in zip(jax.tree.leaves(unbox(fsdp_params)), jax.tree.leaves(dp_params)):
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            wrong.append(f"an FSDP parameter of shape {got.shape} differs from data parallelism's")
    return wrong, {"devices": count, "platform": devices[0].platform, "loss": float(fsdp_loss)}


def worker(part: str, cpu: bool) -> None:
    import torch

    import popmesh

    if part == "jax_fsdp":
        wrong, figures = check_jax_fsdp()
        write_result({"wrong": wrong, **figures})
        return
    dev = device(cpu)
    if part == "gfn":  # the facade forms the world itself, as torchgfn's script has it do
        from popmesh.compat import gfn

        gfn.initialize_distributed_compute("gloo", num_remote_buffers=0, num_agent_groups=1)
        world = popmesh.current_world()
    elif dev.type == "cuda" and torch.cuda.device_count() < int(os.environ.get("WORLD_SIZE", "1")):
        world = popmesh.init(backend="gloo")  # ranks share a GPU: nccl refuses two ranks on one device
    else:
        world = popmesh.init()
    figures: dict[str, object] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                                  "ranks": world.size, "backend": getattr(world.engine, "backend", "")}
    if part == "collectives":
        wrong = check_collectives(world, dev)
    elif part == "grad_sync":
        wrong, more = check_grad_sync(world, dev)
        figures.update(more)
    elif part == "population":
        wrong = check_population(world, dev)
    elif part == "survival":
        wrong, more = check_survival(world, dev)
        figures.update(more)
    else:
        wrong = check_gfn(world, dev)
    everyone = popmesh.all_gather_object(wrong)
    if world.is_main:
        write_result({"wrong": [w for rank_wrong in everyone for w in rank_wrong], **figures})
    world.finalize()


def ranks_for(part: str, cpu: bool) -> int:
    """nccl takes one GPU per rank: as many ranks as GPUs (at most 2) for the parts on nccl; the others
    run 2 ranks, sharing one GPU over gloo where there is only one."""
    if part == "jax_fsdp":
        return 1
    import torch

    gpus = 0 if cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    if part in ("collectives", "grad_sync", "survival") and gpus >= 2:
        return 2
    if part in ("collectives", "grad_sync") and gpus:
        return max(1, min(2, gpus))
    return 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU tensors over gloo")
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run (default all: {','.join(PARTS)})")
    ns = parser.parse_args()
    parts = [p for p in ns.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    failed = 0
    for part in parts:
        env = {"GPU_CHECK_PART": part, "GPU_CHECK_CPU": "1" if ns.cpu else ""}
        if part == "jax_fsdp" and ns.cpu:
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
            env["JAX_PLATFORMS"] = "cpu"
        os.environ.update(env)
        started = time.perf_counter()
        try:
            result = launch_json(os.path.basename(__file__), ranks_for(part, ns.cpu),
                                 "jax" if part == "jax_fsdp" else "torch", timeout=300,
                                 options=("--max-restarts", "1") if part == "survival" else ())
        except Exception as e:  # a world that failed is a failed check, and the next part still runs
            result = {"wrong": [f"the world failed: {e}"]}
        wrong = result.pop("wrong")
        failed += bool(wrong)
        figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
        print(f"{part:12s} {'ok' if not wrong else 'WRONG'}  ({time.perf_counter() - started:.1f} s; {figures})")
        for line in wrong:
            print(f"    {line}")
    print(f"{len(parts) - failed} of {len(parts)} parts right")
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("GPU_CHECK_PART"):  # set by the driver for the worlds it launches
        worker(os.environ["GPU_CHECK_PART"], os.environ.get("GPU_CHECK_CPU") == "1")
    else:
        raise SystemExit(main())
