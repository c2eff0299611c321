"""One process of a 2-process x 4-device JAX world started by `popmesh launch --engine jax`.

Checks a psum over all 8 devices and a data-parallel gradient step against the full-batch
reference, then writes "ok" or the error to $POPMESH_TEST_OUT/process<i>.txt.
"""

import os
import sys
import traceback

import numpy as np


def main() -> None:
    import popmesh.jax as pj

    process = pj.init()
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax

    assert process.distributed and jax.process_count() == 2 and jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), (pj.DATA_AXIS,))
    sharding = NamedSharding(mesh, P(pj.DATA_AXIS))
    rank = jax.process_index()

    local = np.arange(4, dtype=np.float32) + 4 * rank
    x = jax.make_array_from_process_local_data(sharding, local, (8,))
    total = jax.jit(jax.shard_map(lambda v: pj.psum(v, pj.DATA_AXIS), mesh=mesh, in_specs=P("DP"), out_specs=P()))(x)
    assert float(np.asarray(total.addressable_shards[0].data)[0]) == 28.0

    data = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    targets = data @ np.array([1.0, -2.0, 0.5], np.float32)
    params = {"w": jnp.zeros(3)}

    def loss_fn(p, xb, yb):
        return jnp.mean((xb @ p["w"] - yb) ** 2)

    optimizer = optax.sgd(0.1)
    update = pj.make_update(loss_fn, optimizer, pj.DATA_AXIS)
    step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), P(), P("DP"), P("DP")),
                                 out_specs=(P(), P(), P()), check_vma=False))
    rows = slice(32 * rank, 32 * rank + 32)
    xb = jax.make_array_from_process_local_data(sharding, data[rows], (64, 3))
    yb = jax.make_array_from_process_local_data(sharding, targets[rows], (64,))
    _, new_params, _ = step(optimizer.init(params), params, xb, yb)

    grad = jax.grad(loss_fn)(params, data, targets)
    expected = params["w"] - 0.1 * grad["w"]
    got = np.asarray(new_params["w"].addressable_shards[0].data)
    assert np.allclose(got, expected, atol=1e-5), (got, expected)
    pj.shutdown()


if __name__ == "__main__":
    out = os.path.join(os.environ["POPMESH_TEST_OUT"], f"process{os.environ.get('JAX_PROCESS_ID', '0')}.txt")
    try:
        main()
        result = "ok"
    except Exception:
        result = traceback.format_exc()
    with open(out, "w") as f:
        f.write(result)
    sys.exit(0 if result == "ok" else 1)
