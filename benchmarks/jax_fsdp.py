"""FSDP vs plain data parallelism on 8 simulated CPU devices: parameter bytes per device and step time.

Three ways to train the same flax MLP for one adamw step on a batch split over 8 devices:

* ``dp``     plain data parallelism: parameters replicated, gradients averaged (popmesh make_update);
* ``fsdp``   popmesh FSDP inside shard_map: kernels stored as 1/8 shards, gathered per layer;
* ``fsdp-last``  the same with xLSTM's tie rule (square kernels sharded on their last dimension);
* ``gspmd``  the raw engine: jit with the same parameter shardings, collectives left to the compiler.

Prints bytes of parameters held by device 0 and the median step time, with ratios against ``dp``.
Targets: sharded leaves hold 1/8 of their replicated bytes; fsdp step <= 1.3x dp.

    python benchmarks/jax_fsdp.py [--steps 30] [--batch 256] [--width 1024]
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj

AXIS = "fsdp"


class MLP(nn.Module):
    width: int
    fsdp: bool = False
    tie_break: str = "first"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = pj.shard_module(nn.Dense, AXIS, tie_break=self.tie_break) if self.fsdp else nn.Dense
        x = nn.relu(dense(self.width, name="l0")(x))
        x = nn.relu(dense(self.width, name="l1")(x))
        return dense(16, name="head")(x)


def _unbox(tree: Any) -> Any:
    is_p = lambda leaf: isinstance(leaf, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda leaf: leaf.value if is_p(leaf) else leaf, tree, is_leaf=is_p)


def _device0_bytes(tree: Any) -> tuple[int, int]:
    """(bytes of all leaves, bytes of leaves that are sharded) held by the first device."""
    total = sharded = 0
    for leaf in jax.tree.leaves(_unbox(tree)):
        shard = leaf.addressable_shards[0].data
        total += shard.nbytes
        sharded += shard.nbytes if shard.shape != leaf.shape else 0
    return total, sharded


def _shard_map_step(
    model: MLP, mesh: Mesh, specs: Any, opt_specs: Any, optimizer: optax.GradientTransformation
) -> Callable:
    def loss(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    update = pj.make_update(loss, optimizer, dp_axis_name=AXIS)

    def step(opt_state, params, x, y):
        _, params, opt_state = update(opt_state, params, x, y)
        return opt_state, params

    fn = jax.shard_map(
        step, mesh=mesh, in_specs=(opt_specs, specs, P(AXIS), P(AXIS)), out_specs=(opt_specs, specs)
    )
    return jax.jit(fn)


def _gspmd_step(model: MLP, optimizer: optax.GradientTransformation) -> Callable:
    def step(opt_state, params, x, y):
        grads = jax.grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates)

    return jax.jit(step)


def _time_interleaved(paths: dict[str, tuple[Callable, Any, Any]], x: jax.Array, y: jax.Array,
                      steps: int) -> dict[str, float]:
    """Median step seconds per path, rounds interleaved so that load on shared cores hits all alike."""
    state = {name: (opt_state, params) for name, (_, opt_state, params) in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(steps + 1):  # round 0 compiles and warms up
        for name, (step, _, _) in paths.items():
            start = time.perf_counter()
            state[name] = jax.block_until_ready(step(*state[name], x, y))
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


Path = tuple[Callable, Any, Any]  # (jitted step, optimiser state, parameters)


def _fsdp_path(model: MLP, mesh: Mesh, x: jax.Array, optimizer: optax.GradientTransformation) -> Path:
    init = lambda key, x: model.init(key, x)["params"]  # noqa: E731
    params, specs = pj.sharded_init(init, mesh, (P(), P(AXIS)), jax.random.key(0), x)
    # adamw's moments keep the Partitioned boxes, so their specs come out the same way.
    opt_state, opt_specs = pj.sharded_init(optimizer.init, mesh, (specs,), params)
    return _shard_map_step(model, mesh, specs, opt_specs, optimizer), opt_state, params


def _build_paths(width: int, mesh: Mesh, x: jax.Array) -> dict[str, Path]:
    """The four ways to train; all start from the same initial weights (same init key and shapes)."""
    optimizer = optax.adamw(1e-3, weight_decay=1e-4)
    fsdp = _fsdp_path(MLP(width, fsdp=True), mesh, x, optimizer)
    full = _unbox(fsdp[2])  # global arrays of the shards are the full tensors
    dp_params = jax.device_put(full, NamedSharding(mesh, P()))
    dp_opt, dp_opt_specs = pj.sharded_init(optimizer.init, mesh, (P(),), dp_params)
    gspmd_shardings = jax.tree.map(lambda leaf: leaf.sharding, full)
    gspmd_params = jax.device_put(full, gspmd_shardings)
    return {
        "dp": (_shard_map_step(MLP(width), mesh, P(), dp_opt_specs, optimizer), dp_opt, dp_params),
        "fsdp": fsdp,
        "fsdp-last": _fsdp_path(MLP(width, fsdp=True, tie_break="last"), mesh, x, optimizer),
        "gspmd": (_gspmd_step(MLP(width), optimizer), jax.jit(optimizer.init)(gspmd_params), gspmd_params),
    }


def _report(paths: dict[str, Path], seconds: dict[str, float]) -> None:
    dp_bytes, _ = _device0_bytes(paths["dp"][2])
    print(f"{'path':9s} {'param bytes/device':>19s} {'ratio':>6s} {'sharded-leaf ratio':>19s} "
          f"{'step ms':>8s} {'ratio':>6s}")
    for name, (_, _, params) in paths.items():
        total, sharded = _device0_bytes(params)
        full_of_sharded = sum(
            leaf.nbytes for leaf in jax.tree.leaves(_unbox(params))
            if leaf.addressable_shards[0].data.shape != leaf.shape
        )
        leaf_ratio = f"{sharded / full_of_sharded:.4f}" if full_of_sharded else "-"
        print(f"{name:9s} {total:19,d} {total / dp_bytes:6.3f} {leaf_ratio:>19s} "
              f"{seconds[name] * 1e3:8.2f} {seconds[name] / seconds['dp']:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()

    mesh = Mesh(np.asarray(jax.devices()[:8]), (AXIS,))
    x = jax.random.normal(jax.random.key(1), (args.batch, args.width))
    y = jax.random.normal(jax.random.key(2), (args.batch, 16))
    paths = _build_paths(args.width, mesh, x)
    n_params = sum(leaf.size for leaf in jax.tree.leaves(_unbox(paths["dp"][2])))
    print(f"MLP width {args.width}: {n_params:,} parameters, batch {args.batch}, 8 CPU devices, "
          f"jax {jax.__version__}, {os.cpu_count()} host cores; median of {args.steps} interleaved steps")
    _report(paths, _time_interleaved(paths, x, y, args.steps))


if __name__ == "__main__":
    main()
