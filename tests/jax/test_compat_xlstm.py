"""popmesh.compat.xlstm_jax: the seed document's signatures, and each documented behaviour on 8 devices."""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax
import popmesh.compat.xlstm_jax as dp
import popmesh.jax as pj

sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import facade_mismatches, require_seed

N = 8


@pytest.fixture(scope="module")
def fsdp_mesh(devices):
    return Mesh(np.asarray(devices), ("fsdp",))


def test_facade_matches_the_seed_document():
    seed = require_seed("xlstm_jax.distributed.data_parallel")
    assert facade_mismatches(dp, seed) == []
    assert not any(entry.examples for entry in seed.entries.values())  # behaviours are tested one by one below


def _params():
    shapes = {"square": (16, 16), "tall": (24, 16), "odd": (3, 5), "tiny": (4,)}
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return {name: jax.random.normal(k, shape) for (name, shape), k in zip(shapes.items(), keys)}


def _on_every_device(mesh, body, *args):
    """Run ``body`` in shard_map with replicated inputs; returns (tree seen on a device, outputs)."""
    seen = {}

    def wrapped(*args):
        tree, out = body(*args)
        seen["tree"] = tree
        return out

    out = jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))(*args)
    return seen["tree"], out


def test_shard_params_uses_the_xlstm_layout(fsdp_mesh):
    params = _params()

    def body(params):
        sharded = dp.shard_params(params, "fsdp", min_weight_size=8)
        return sharded, pj.all_gather(sharded, "fsdp")

    tree, stacked = _on_every_device(fsdp_mesh, body, params)
    assert jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned)) == jax.tree.structure(params)
    assert tree["square"].names == (None, "fsdp")  # a tie goes to the last dim (popmesh's own default: first)
    assert tree["square"].value.shape == (16, 2)
    assert tree["tall"].names == ("fsdp", None) and tree["tall"].value.shape == (3, 16)
    assert not isinstance(tree["odd"], nn.Partitioned) and not isinstance(tree["tiny"], nn.Partitioned)
    for key, dim in (("square", 1), ("tall", 0)):
        blocks = np.split(np.asarray(params[key]), N, axis=dim)
        for device in range(N):
            assert np.array_equal(stacked[key].value[device], blocks[device])


def test_default_threshold_is_2_to_the_18(fsdp_mesh):
    big = {"w": jnp.ones((2**18 // 8, 8)), "v": jnp.ones((2**18 // 8 + 8, 8))}  # exactly 2**18, then more
    tree, _ = _on_every_device(fsdp_mesh, lambda p: (dp.shard_params(p, "fsdp"), 0.0), big)
    assert not isinstance(tree["w"], nn.Partitioned)
    assert tree["v"].names == ("fsdp", None)


def test_gather_params_round_trips(fsdp_mesh):
    params = _params()

    def body(params):
        sharded = dp.shard_params(params, "fsdp", min_weight_size=8)
        return sharded, dp.gather_params(sharded, "fsdp")

    _, gathered = _on_every_device(fsdp_mesh, body, params)
    for key in params:
        assert np.array_equal(gathered[key], params[key]), key


def test_gathered_gradient_is_the_mean_over_replicas(fsdp_mesh):
    full = jnp.arange(16.0).reshape(2, 8)
    coef = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)

    def body(w_local, weight):  # device r weighs its loss by r + 1
        def loss(w):
            return weight[0] * jnp.sum(dp.gather_array_with_mean_grads(w, 1, "fsdp") * coef)

        return jax.grad(loss)(pj.as_varying(w_local, "fsdp"))

    fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=(P(None, "fsdp"), P("fsdp")), out_specs=P(None, "fsdp"))
    grad = jax.jit(fn)(full, jnp.arange(1.0, N + 1))
    assert np.allclose(grad, 4.5 * coef)  # mean of the weights 1..8


def test_gather_dtype_and_grad_scatter_dtype(fsdp_mesh):
    w = jax.random.normal(jax.random.key(3), (4, 16)) / 3
    x = jax.random.normal(jax.random.key(4), (N * 2, 16))

    def grads(gather_dtype, scatter_dtype):
        def body(x, w):
            def loss(w):
                full = dp.gather_array_with_mean_grads(w, 1, "fsdp", gather_dtype, scatter_dtype)
                assert full.dtype == (gather_dtype or jnp.float32)
                return jnp.mean((x @ full.T.astype(jnp.float32)) ** 2)

            return jax.grad(loss)(pj.as_varying(w, "fsdp"))

        fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=(P("fsdp"), P(None, "fsdp")), out_specs=P(None, "fsdp"))
        return np.asarray(jax.jit(fn)(x, w))

    f32, bf16 = grads(None, None), grads(jnp.bfloat16, jnp.bfloat16)
    assert bf16.dtype == np.float32  # cast back to the parameter dtype
    assert not np.array_equal(f32, bf16) and np.allclose(f32, bf16, rtol=5e-2, atol=2e-2 * np.abs(f32).max())


def test_shard_module_params_shards_a_dense_layer(fsdp_mesh):
    Dense = dp.shard_module_params(nn.Dense, "fsdp", min_weight_size=8)
    x = jax.random.normal(jax.random.key(5), (3, 16))

    def body(key, x):
        variables = Dense(16).init(key, x)
        out = Dense(16).apply(variables, x)
        kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
        return (kernel, bias), (out, pj.all_gather(kernel.value, "fsdp", axis=1, tiled=True),
                                pj.all_gather(bias.value, "fsdp", tiled=True))

    (kernel, bias), (out, full_kernel, full_bias) = _on_every_device(fsdp_mesh, body, jax.random.key(6), x)
    assert kernel.names == (None, "fsdp") and kernel.value.shape == (16, 2)  # square: last dim, as in xLSTM
    assert bias.names == ("fsdp",) and bias.value.shape == (2,)
    assert np.allclose(out, x @ full_kernel + full_bias, atol=1e-5)


def test_sync_gradients_skips_axes_a_gradient_is_sharded_on(devices):
    mesh = Mesh(np.asarray(devices).reshape(2, 4), ("dp", "fsdp"))
    grid = ("dp", "fsdp")

    def body(rank):  # device (d, f) holds 4d + f + 1
        synced = dp.sync_gradients({"replicated": rank, "sharded": nn.Partitioned(rank, ("fsdp",))}, grid)
        return synced["replicated"], synced["sharded"].value

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(grid), out_specs=(P(), P(grid)))
    replicated, sharded = jax.jit(fn)(jnp.arange(1.0, N + 1))
    assert np.allclose(replicated, 4.5)  # averaged over all 8 devices
    assert np.allclose(sharded, np.arange(N) % 4 + 3.0)  # averaged over dp only: (f + 1 + f + 5) / 2


def test_sync_gradients_warns_when_autodiff_already_summed_replicated_gradients(fsdp_mesh):
    """Under shard_map(check_vma=True) JAX sums a replicated parameter's gradient over the devices; the
    facade returns that sum as upstream does (N times the mean), and says so once at trace time."""
    w = jnp.ones(4)

    def body(w, x):
        grads = jax.grad(lambda w: jnp.sum(w * x))(w)  # w replicated: autodiff sums over "fsdp"
        return dp.sync_gradients(grads, ("fsdp",))

    fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=(P(), P("fsdp")), out_specs=P())  # check_vma=True
    with pytest.warns(RuntimeWarning, match="already SUMMED"):
        summed = jax.jit(fn)(w, jnp.ones(4 * N))
    assert np.allclose(summed, N * np.ones(4)), summed  # upstream's result: N times the mean gradient


def test_shard_params_outside_shard_map_names_itself():
    with pytest.raises(pj.UnboundAxisError) as caught:
        dp.shard_params(_params(), "fsdp")
    assert "shard_params" in str(caught.value) and "axis_size" not in str(caught.value), str(caught.value)


def test_gather_and_scatter_dtype_matrix_as_xlstm_tests_it(fsdp_mesh):
    """xlstm-jax's tests/distributed/test_data_parallel.py: the loss casts the gathered weight to bfloat16,
    so gathering in float32 then casting equals gathering in bfloat16 (for each scatter dtype), while
    scattering the gradient in another dtype changes it."""
    w = jax.random.normal(jax.random.key(5), (4 * N, 6))  # each device holds 4 rows
    x = jax.random.normal(jax.random.key(6), (16 * N, 4 * N))  # and its own 16 samples
    target = jax.random.normal(jax.random.key(7), (16 * N, 6))

    def grads(gather_dtype, scatter_dtype):
        def body(w, x, target):
            def loss(w):
                full = dp.gather_array_with_mean_grads(w, 0, "fsdp", gather_dtype, scatter_dtype)
                out = x.astype(jnp.bfloat16) @ full.astype(jnp.bfloat16)
                return jnp.mean((out.astype(jnp.float32) - target) ** 2)

            return jax.grad(loss)(w)

        fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=(P("fsdp"),) * 3, out_specs=P("fsdp"))
        return np.asarray(jax.jit(fn)(w, x, target))

    got = {(g, s): grads(g, s) for g in (jnp.float32, jnp.bfloat16) for s in (jnp.float32, jnp.bfloat16, jnp.float16)}
    for s in (jnp.float32, jnp.bfloat16):
        assert np.array_equal(got[jnp.float32, s], got[jnp.bfloat16, s]), s
    assert not np.array_equal(got[jnp.float32, jnp.float32], got[jnp.float32, jnp.bfloat16])
    assert not np.array_equal(got[jnp.float32, jnp.float32], got[jnp.float32, jnp.float16])
    assert all(g.dtype == np.float32 for g in got.values())  # cast back to the parameter's dtype
