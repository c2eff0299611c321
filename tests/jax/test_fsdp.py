"""FSDP inside shard_map (xLSTM parity): sharding rules, gathers, mean-gradients, parity with DP."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj
from popmesh.core.errors import ConfigError

N = 8


@pytest.fixture(scope="module")
def fsdp_mesh(devices):
    return Mesh(np.asarray(devices), ("fsdp",))


@pytest.fixture(scope="module")
def dp_fsdp_mesh(devices):
    return Mesh(np.asarray(devices).reshape(2, 4), ("dp", "fsdp"))


def _full_params():
    shapes = {"square": (16, 16), "tall": (24, 16), "odd_rows": (12, 16), "odd": (3, 5), "tiny": (4,)}
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return {name: jax.random.normal(k, shape) for (name, shape), k in zip(shapes.items(), keys)}


def _shard_on_every_device(mesh, params, **kwargs):
    """shard_tree on each device; returns (structure seen on device 0, values stacked per device)."""
    seen = {}

    def body(params):
        sharded = pj.shard_tree(params, "fsdp", **kwargs)
        seen["tree"] = sharded
        return pj.all_gather(sharded, "fsdp")

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    stacked = fn(params)
    return seen["tree"], stacked


@pytest.mark.parametrize("tie_break", ["first", "last"])
def test_shard_tree_picks_the_largest_divisible_dim(fsdp_mesh, caplog, tie_break):
    params = _full_params()
    with caplog.at_level(logging.DEBUG, logger="popmesh.jax.fsdp"):
        tree, stacked = _shard_on_every_device(fsdp_mesh, params, min_weight_size=4, tie_break=tie_break)
    names = {k: getattr(v, "names", None) for k, v in tree.items()}
    square_dim = 0 if tie_break == "first" else 1  # (16, 16): a tie
    assert names == {"square": ((None, "fsdp") if square_dim else ("fsdp", None)), "tall": ("fsdp", None),
                     "odd_rows": (None, "fsdp"), "odd": None, "tiny": None}
    for key, dim in (("square", square_dim), ("tall", 0), ("odd_rows", 1)):
        blocks = np.split(np.asarray(params[key]), N, axis=dim)
        for device in range(N):
            assert np.array_equal(stacked[key].value[device], blocks[device])
    assert "['odd'] replicated: no free dim of (3, 5) divisible by 8" in caplog.text
    assert "['tiny'] replicated: size 4 <= min_weight_size 4" in caplog.text


def test_shard_tree_default_threshold_keeps_small_leaves_replicated(fsdp_mesh):
    tree, _ = _shard_on_every_device(fsdp_mesh, _full_params())  # largest leaf: 384 values < 2**18
    assert all(not isinstance(leaf, nn.Partitioned) for leaf in tree.values())


def test_bad_tie_break_is_rejected(fsdp_mesh):
    with pytest.raises(ConfigError, match="tie_break"):
        _shard_on_every_device(fsdp_mesh, _full_params(), tie_break="middle")


def test_already_sharded_leaf_is_left_alone(fsdp_mesh, caplog):
    leaf = nn.Partitioned(jnp.ones((16, 16)), ("fsdp", None))
    with caplog.at_level(logging.WARNING, logger="popmesh.jax.fsdp"):
        tree, _ = _shard_on_every_device(fsdp_mesh, {"w": leaf}, min_weight_size=0)
    assert tree["w"].names == ("fsdp", None) and tree["w"].value.shape == (16, 16)
    assert "already sharded over 'fsdp'" in caplog.text


def test_named_dims_are_not_resharded(fsdp_mesh):
    leaf = nn.Partitioned(jnp.ones((16, 8)), ("tp", None))
    tree, _ = _shard_on_every_device(fsdp_mesh, {"w": leaf}, min_weight_size=0)
    assert tree["w"].names == ("tp", "fsdp") and tree["w"].value.shape == (16, 1)


@pytest.mark.parametrize("pad", [False, True])
def test_gather_tree_round_trips_and_pad_trims_back(fsdp_mesh, pad):
    params = _full_params()
    seen = {}

    def body(params):
        sharded = pj.shard_tree(params, "fsdp", min_weight_size=4, pad=pad)
        seen["odd"] = sharded["odd"]
        return pj.gather_tree(sharded, "fsdp")

    # Gathered tensors stay typed as varying (their gradient is per-device), hence check_vma=False.
    out = jax.shard_map(body, mesh=fsdp_mesh, in_specs=P(), out_specs=P(), check_vma=False)(params)
    for key in params:
        assert np.array_equal(out[key], params[key]), key
    if pad:
        assert isinstance(seen["odd"], pj.PaddedPartitioned)
        assert seen["odd"].unpadded == 5 and seen["odd"].value.shape == (3, 1)
    else:
        assert not isinstance(seen["odd"], nn.Partitioned)


def test_gather_keeps_other_sharded_axes(fsdp_mesh):
    seen = {}

    def body(w):
        gathered = pj.gather_tree({"w": nn.Partitioned(w, ("tp", "fsdp"))}, "fsdp")["w"]
        seen["names"] = gathered.names
        return gathered.value

    fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=P(None, "fsdp"), out_specs=P(), check_vma=False)
    assert fn(jnp.ones((2, 16))).shape == (2, 16)
    assert seen["names"] == ("tp", None)


@pytest.mark.parametrize("check_vma", [True, False])
def test_gather_gradient_is_the_mean_over_devices(fsdp_mesh, check_vma):
    full = jnp.arange(16.0).reshape(2, 8)
    coef = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)

    def body(w_local, weight):
        def loss(w):
            gathered = pj.gather_with_mean_grads(w, 1, "fsdp")
            return weight[0] * jnp.sum(gathered * coef), gathered

        grad, gathered = jax.grad(loss, has_aux=True)(pj.as_varying(w_local, "fsdp"))
        return grad, pj.pmax(gathered, "fsdp")

    fn = jax.shard_map(body, mesh=fsdp_mesh, in_specs=(P(None, "fsdp"), P("fsdp")),
                       out_specs=(P(None, "fsdp"), P()), check_vma=check_vma)
    grad, gathered = fn(full, jnp.arange(1.0, N + 1))
    assert np.array_equal(gathered, full)
    assert np.allclose(grad, np.mean(np.arange(1, N + 1)) * coef)  # weights 1..8 → 4.5 × coef


def _scatter_dtype_grads(mesh, gather_dtype, scatter_dtype):
    x = jax.random.normal(jax.random.key(1), (N * 4, 32))
    weight = jax.random.normal(jax.random.key(2), (32, 16)) / 3

    def body(x, w):
        def loss(w):
            full = pj.gather_with_mean_grads(w, 1, "fsdp", gather_dtype, scatter_dtype)
            return jnp.mean((x @ full.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

        return jax.grad(loss)(pj.as_varying(w, "fsdp"))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P(None, "fsdp")), out_specs=P(None, "fsdp"))
    return np.asarray(jax.jit(fn)(x, weight))


def test_bfloat16_scatter_changes_gradients_a_little(fsdp_mesh):
    f32 = _scatter_dtype_grads(fsdp_mesh, None, None)
    f32_cast = _scatter_dtype_grads(fsdp_mesh, jnp.bfloat16, jnp.float32)
    bf16 = _scatter_dtype_grads(fsdp_mesh, jnp.bfloat16, jnp.bfloat16)
    assert f32.dtype == bf16.dtype == np.float32  # cast back to the parameter dtype
    assert np.array_equal(f32, f32_cast)  # gathering in bf16 == gathering in f32 then casting
    assert not np.array_equal(f32, bf16)
    assert np.allclose(f32, bf16, rtol=5e-2, atol=1e-2 * np.abs(f32).max())


def test_gather_dtype_sets_the_forward_dtype(fsdp_mesh):
    fn = jax.shard_map(lambda w: pj.gather_with_mean_grads(w, 0, "fsdp", gather_dtype=jnp.bfloat16),
                       mesh=fsdp_mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False)
    assert fn(jnp.ones(16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("check_vma", [True, False])
def test_mean_grads_skips_axes_a_leaf_is_sharded_on(dp_fsdp_mesh, check_vma):
    grid = ("dp", "fsdp")

    def body(rank):  # device (d, f) holds rank + 1 = 4d + f + 1
        synced = pj.mean_grads({"replicated": rank, "sharded": nn.Partitioned(rank, ("fsdp",))}, grid)
        return synced["replicated"], synced["sharded"].value

    fn = jax.shard_map(
        body, mesh=dp_fsdp_mesh, in_specs=P(grid), out_specs=(P(), P(grid)), check_vma=check_vma
    )
    replicated, sharded = fn(jnp.arange(1.0, N + 1))
    assert np.allclose(replicated, 4.5)  # mean over all 8 devices
    assert np.allclose(sharded, np.arange(N) % 4 + 3.0)  # mean over dp only: (f + 1 + f + 5) / 2


def test_mean_grads_leaves_jax_reduced_leaves_alone(dp_fsdp_mesh):
    def body(invariant):
        return pj.mean_grads({"g": invariant}, ("dp", "fsdp"))["g"]

    fn = jax.shard_map(body, mesh=dp_fsdp_mesh, in_specs=P(), out_specs=P())
    assert np.allclose(fn(jnp.full(3, 7.0)), 7.0)


# --- FSDP training of a small flax MLP equals plain data parallelism -------------------------------

class MLP(nn.Module):
    sharded_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense
        if self.sharded_axis is not None:
            dense = pj.shard_module(nn.Dense, self.sharded_axis, min_weight_size=128)
        x = nn.relu(dense(64, name="hidden")(x))
        return dense(4, name="out")(x)


def _train(model, mesh, axes, params, specs, x, y, check_vma, steps=3):
    optimizer = optax.adamw(0.01, weight_decay=0.1)

    def loss(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    step = pj.make_update(loss, optimizer, dp_axis_name=axes)

    def body(params, x, y):
        opt_state = optimizer.init(params)
        for _ in range(steps):
            value, params, opt_state = step(opt_state, params, x, y)
        return pj.pmean(value, axes), params

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axes), P(axes)), out_specs=(P(), specs),
                       check_vma=check_vma)
    return jax.jit(fn)(params, x, y)


def _unbox(params):
    return jax.tree.map(lambda leaf: leaf.value if isinstance(leaf, nn.Partitioned) else leaf, params,
                        is_leaf=lambda leaf: isinstance(leaf, nn.Partitioned))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mesh_name", ["fsdp_mesh", "dp_fsdp_mesh"])
def test_fsdp_mlp_training_equals_plain_dp(request, mesh_name, check_vma):
    mesh = request.getfixturevalue(mesh_name)
    axes = mesh.axis_names
    x = jax.random.normal(jax.random.key(1), (64, 16))
    y = jnp.sin(x[:, :4])
    fsdp_model = MLP(sharded_axis="fsdp")
    init = lambda key, x: fsdp_model.init(key, x)["params"]  # noqa: E731
    params, specs = pj.sharded_init(init, mesh, (P(), P(axes)), jax.random.key(0), x, check_vma=check_vma)

    assert specs["hidden"]["kernel"] == P(None, "fsdp") and specs["out"]["kernel"] == P("fsdp", None)
    assert specs["hidden"]["bias"] == P() and specs["out"]["bias"] == P()
    n_fsdp = mesh.shape["fsdp"]
    assert {s.data.shape for s in params["hidden"]["kernel"].value.addressable_shards} == {(16, 64 // n_fsdp)}
    assert {s.data.shape for s in params["out"]["kernel"].value.addressable_shards} == {(64 // n_fsdp, 4)}

    fsdp_loss, fsdp_params = _train(fsdp_model, mesh, axes, params, specs, x, y, check_vma)
    plain = _unbox(params)  # global arrays of the shards are the full tensors
    dp_loss, dp_params = _train(MLP(), mesh, axes, plain, P(), x, y, check_vma)

    assert np.allclose(fsdp_loss, dp_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(_unbox(fsdp_params)), jax.tree.leaves(dp_params)):
        assert got.shape == want.shape
        assert np.allclose(got, want, rtol=1e-4, atol=1e-6)
    assert fsdp_params["hidden"]["kernel"].value.sharding.spec == P(None, "fsdp")
    assert not np.allclose(dp_params["hidden"]["kernel"], plain["hidden"]["kernel"])
