"""Population × data parallelism on 8 simulated CPU devices.

Eight small regressors (a population, e.g. for population-based training), each with its own learning
rate, are split over the ``POP`` mesh axis (2 members per device column); each member's batch is split
over the ``DP`` axis and its gradients are averaged there by ``popmesh.jax.make_update``. After
each round the worst quarter of the population takes the best member's weights (in-graph, with
``popmesh.jax.population_update``), keeping its own learning rate.

    python examples/jax_population_dp.py
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax
from popmesh.jax import (
    DATA_AXIS,
    POPULATION_AXIS,
    make_update,
    pmean,
    population_update,
    vmap_per_device,
)

POP_SIZE, N_POP, N_DP = 8, 4, 2
BATCH, STEPS_PER_CALL, CALLS = 512, 50, 6


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))


MODEL = Regressor()
OPTIMIZER = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)  # each member's rate lives in its state


def mse(params, x, y):
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def member_train(params, opt_state, x, y):
    """One member, ``STEPS_PER_CALL`` steps on its DP shard of the batch; returns its mean loss."""
    step = make_update(mse, OPTIMIZER, dp_axis_name=DATA_AXIS)

    def body(carry, _):
        params, opt_state = carry
        loss, params, opt_state = step(opt_state, params, x, y)
        return (params, opt_state), loss

    (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), length=STEPS_PER_CALL)
    return params, opt_state, pmean(losses[-1], DATA_AXIS)


def main() -> None:
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(N_POP, N_DP), (POPULATION_AXIS, DATA_AXIS))
    x = jnp.linspace(-2.0, 2.0, BATCH)[:, None]
    y = jnp.sin(3.0 * x) + 0.05 * jax.random.normal(jax.random.key(1), x.shape)
    learning_rates = jnp.logspace(-3.5, -1.0, POP_SIZE)
    params = jax.vmap(lambda k: MODEL.init(k, x[:1])["params"])(jax.random.split(jax.random.key(0), POP_SIZE))
    opt_state = jax.vmap(lambda p, lr: optax.inject_hyperparams(optax.adam)(learning_rate=lr).init(p))(
        params, learning_rates
    )
    train = jax.jit(vmap_per_device(
        member_train, mesh,
        in_specs=(P(POPULATION_AXIS), P(POPULATION_AXIS), P(DATA_AXIS), P(DATA_AXIS)),
        out_specs=(P(POPULATION_AXIS), P(POPULATION_AXIS), P(POPULATION_AXIS)),
        in_axes=(0, 0, None, None),  # members are mapped; the data shard is shared by a device's members
    ))
    exploit = population_update(mesh, P(POPULATION_AXIS), replacement_ratio=0.25, strategy="best_only")
    start = time.perf_counter()
    for call in range(1, CALLS + 1):
        params, opt_state, losses = train(params, opt_state, x, y)
        print(f"step {call * STEPS_PER_CALL:4d}  loss per member: " + " ".join(f"{v:.4f}" for v in losses))
        if call < CALLS:
            params, replaced = exploit(params, -losses)  # higher metric = better
            print(f"           replaced by the best member: {np.flatnonzero(np.asarray(replaced)).tolist()}")
    for member, (lr, loss) in enumerate(zip(learning_rates, losses)):
        print(f"member {member}: lr={float(lr):.5f}  final loss={float(loss):.4f}")
    elapsed = time.perf_counter() - start
    print(f"best member: {int(jnp.argmin(losses))}  ({elapsed:.1f}s on mesh {dict(mesh.shape)})")


if __name__ == "__main__":
    main()
