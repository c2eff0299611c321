"""popmesh.compat.evorl: the seed document's signatures, and each documented behaviour on 8 devices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import flax.struct
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax
import popmesh.compat.evorl as evorl
from popmesh.jax import UnboundAxisError

sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import facade_mismatches, require_seed

N = 8


def test_facade_matches_the_seed_document():
    seed = require_seed("evorl.distributed")
    assert facade_mismatches(evorl, seed) == []
    assert not any(entry.examples for entry in seed.entries.values())  # behaviours are tested one by one below


def test_importing_popmesh_compat_imports_no_engine():
    code = "import sys, popmesh.compat; assert not {'jax', 'torch', 'mpi4py'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_axis_names():
    assert (evorl.DP_AXIS_NAME, evorl.POP_AXIS_NAME) == ("DP", "POP")


def _over_dp(mesh, body, x, check_vma=True):
    return jax.shard_map(body, mesh=mesh, in_specs=P("DP"), out_specs=P(), check_vma=check_vma)(x)


def test_collectives_over_a_dp_mesh(dp_mesh):
    ranks = jnp.arange(1.0, N + 1)  # device r holds r + 1

    def body(x):
        tree = {"x": x, "pair": (x, 2 * x)}
        return [op(tree, evorl.DP_AXIS_NAME) for op in (evorl.pmean, evorl.psum, evorl.pmin, evorl.pmax)]

    mean, total, low, high = _over_dp(dp_mesh, body, ranks)
    assert np.allclose(mean["x"], 4.5) and np.allclose(mean["pair"][1], 9.0)
    assert np.allclose(total["x"], 36.0) and np.allclose(total["pair"][1], 72.0)
    assert np.allclose(low["x"], 1.0) and np.allclose(high["pair"][0], 8.0)


def test_no_axis_is_the_identity_and_an_unbound_axis_is_reported():
    tree = {"w": jnp.ones(3)}
    for op in (evorl.pmean, evorl.psum, evorl.pmin, evorl.pmax):
        assert op(tree) is tree and op(tree, None) is tree
    with pytest.raises(UnboundAxisError, match="'DP' is not bound") as info:
        jax.jit(lambda x: evorl.pmean(x, "DP"))(jnp.ones(2))
    assert isinstance(info.value, NameError)  # code catching JAX's NameError keeps working


def test_all_gather(dp_mesh):
    x = jnp.arange(2.0 * N)  # device d holds [2d, 2d + 1]
    # all_gather's result is typed as varying, so returning it with P() needs check_vma=False
    tiled = _over_dp(dp_mesh, lambda s: evorl.all_gather(s, "DP", axis=0, tiled=True), x, check_vma=False)
    stacked = _over_dp(dp_mesh, lambda s: evorl.all_gather(s, "DP"), x, check_vma=False)
    assert np.array_equal(tiled, x)
    assert np.array_equal(stacked, x.reshape(N, 2))
    local = jnp.arange(2.0)
    assert evorl.all_gather(local, None, tiled=True) is local
    assert evorl.all_gather(local).shape == (1, 2)  # fixed: same rank as the (N, 2) result above


def test_global_ranks_process_id_and_initialisation(devices):
    ranks = evorl.get_global_ranks()
    assert ranks.dtype == jnp.int32 and np.array_equal(ranks, np.arange(N))
    shards = sorted(ranks.addressable_shards, key=lambda s: int(s.data[0]))
    assert [s.data.shape for s in shards] == [(1,)] * N
    assert [s.device for s in shards] == devices  # each device holds its own unique rank
    assert evorl.get_process_id() == 0
    assert evorl.is_dist_initialized() is False


BATCH = 32


def _problem():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(k1, (4, 2)), "b": jnp.zeros(2)}
    x = jax.random.normal(k2, (BATCH, 4))
    y = x @ jnp.array([[1.0, -1.0], [2.0, 0.5], [0.0, 1.0], [-1.0, 3.0]])
    return params, x, y


def mse(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _reference(optimizer, params, x, y, steps):
    state = optimizer.init(params)
    for _ in range(steps):
        grads = jax.grad(mse)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_gradient_update_with_adamw_equals_the_full_batch_step(dp_mesh):
    params, x, y = _problem()
    optimizer = optax.adamw(0.05, weight_decay=0.1)  # needs params in update: EvoRL raised ValueError
    step = evorl.gradient_update(mse, optimizer, evorl.DP_AXIS_NAME)

    def body(opt_state, params, x, y):
        for _ in range(3):
            loss, params, opt_state = step(opt_state, params, x, y)
        return evorl.pmean(loss, "DP"), params, opt_state

    fn = jax.shard_map(body, mesh=dp_mesh, in_specs=(P(), P(), P("DP"), P("DP")), out_specs=(P(), P(), P()))
    loss, new_params, opt_state = jax.jit(fn)(optimizer.init(params), params, x, y)
    expected = _reference(optimizer, params, x, y, 3)
    for key in params:
        assert np.allclose(new_params[key], expected[key], rtol=1e-5, atol=1e-6)
    assert int(opt_state[0].count) == 3 and np.isfinite(loss)


def test_gradient_update_on_one_device_with_aux_and_a_required_axis_argument():
    params, x, y = _problem()
    optimizer = optax.sgd(0.1)

    def loss_with_aux(params, x, y):
        loss = mse(params, x, y)
        return loss, {"twice": 2 * loss}

    (loss, aux), new_params, _ = evorl.gradient_update(loss_with_aux, optimizer, None, has_aux=True)(
        optimizer.init(params), params, x, y)
    assert np.allclose(aux["twice"], 2 * loss)
    assert np.allclose(new_params["w"], _reference(optimizer, params, x, y, 1)["w"])
    with pytest.raises(TypeError, match="dp_axis_name"):
        evorl.gradient_update(mse, optimizer)  # required in the seed signature


@flax.struct.dataclass
class AgentState:
    params: dict
    obs_offset: jax.Array


def agent_loss(agent_state, sample_batch, key):
    """EvoRL's arity: (agent_state, sample_batch, key)."""
    x, y = sample_batch
    noise = 0.0 * jax.random.normal(key, ())
    return mse(agent_state.params, x - agent_state.obs_offset, y) + noise


def test_agent_gradient_update_trains_only_the_params(dp_mesh):
    params, x, y = _problem()
    optimizer = optax.adam(0.05)
    state = AgentState(params, jnp.full(4, 0.5))
    step = evorl.agent_gradient_update(agent_loss, optimizer, evorl.DP_AXIS_NAME)

    def body(opt_state, state, x, y, key):
        return step(opt_state, state, (x, y), key)[1]

    fn = jax.shard_map(body, mesh=dp_mesh, in_specs=(P(), P(), P("DP"), P("DP"), P()), out_specs=P())
    new_state = jax.jit(fn)(optimizer.init(params), state, x, y, jax.random.key(1))
    expected = _reference(optimizer, params, x - 0.5, y, 1)
    assert np.allclose(new_state.params["w"], expected["w"], rtol=1e-5, atol=1e-6)
    assert np.array_equal(new_state.obs_offset, state.obs_offset)


def test_agent_gradient_update_with_custom_attach_and_detach():
    params, x, y = _problem()
    optimizer = optax.sgd(0.1)
    state = {"policy": params, "steps": 7}

    def loss(state, x, y):
        return mse(state["policy"], x, y)

    step = evorl.agent_gradient_update(
        loss, optimizer, attach_fn=lambda s, p: {**s, "policy": p}, detach_fn=lambda s: s["policy"])
    _, new_state, _ = step(optimizer.init(params), state, x, y)
    assert new_state["steps"] == 7
    assert np.allclose(new_state["policy"]["w"], _reference(optimizer, params, x, y, 1)["w"])


POP = 2 * N


@pytest.fixture(scope="module")
def pop_mesh(devices):
    return Mesh(np.asarray(devices), (evorl.POP_AXIS_NAME,))


@pytest.mark.parametrize("helper", [evorl.shmap_vmap, evorl.shmap_map], ids=["vmap", "map"])
def test_population_helpers_map_every_member(pop_mesh, helper):
    weights = jnp.arange(POP * 3, dtype=jnp.float32).reshape(POP, 3)
    offsets = jnp.arange(POP, dtype=jnp.float32)

    def member(w, o):  # positional arguments only, every one mapped over its leading axis
        return jnp.sum(w**2) + o

    fn = helper(member, pop_mesh, (P("POP"), P("POP")), P("POP"))
    assert np.allclose(jax.jit(fn)(weights, offsets), jax.vmap(member)(weights, offsets))
    with pytest.warns(DeprecationWarning, match="check_vma"):
        legacy = helper(member, pop_mesh, (P("POP"), P("POP")), P("POP"), check_rep=False)
    assert np.allclose(legacy(weights, offsets), jax.vmap(member)(weights, offsets))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_split_key_to_devices(devices, make_key):
    key = make_key(0)
    keys = evorl.split_key_to_devices(key, devices)
    assert keys.shape == (N, *key.shape)
    data = jax.random.key_data if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else np.asarray
    assert np.array_equal(data(keys), data(jax.random.split(key, N)))
    for shard in keys.addressable_shards:
        assert shard.data.shape == (1, *key.shape)
        assert shard.device == devices[shard.index[0].start]


def test_tree_device_put(devices, dp_mesh):
    tree = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2))]}
    on_device = evorl.tree_device_put(tree, devices[3])
    assert all(leaf.devices() == {devices[3]} for leaf in jax.tree.leaves(on_device))
    replicated = NamedSharding(dp_mesh, P())
    spread = evorl.tree_device_put(tree, replicated)
    assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(spread))
    assert np.array_equal(spread["b"][0], tree["b"][0])


def test_gradient_update_averages_every_leaf_as_evorl_does(dp_mesh):
    """EvoRL pmeans every gradient leaf; an nn.Partitioned leaf named with the DP axis too (popmesh's
    own make_update would leave such an FSDP shard's gradient alone along the axis it is sharded on)."""
    import flax.linen as nn

    n = dp_mesh.shape["DP"]
    params = {"p": nn.Partitioned(jnp.zeros(4), names=("DP",))}
    x = jnp.arange(4.0 * n)  # device d sees x[4d:4d+4]
    step = evorl.gradient_update(lambda params, x: jnp.sum(params["p"].value * x), optax.sgd(1.0), evorl.DP_AXIS_NAME)

    def body(params, x):
        optimizer_state = optax.sgd(1.0).init(params)
        _, new_params, _ = step(optimizer_state, params, x)
        return new_params["p"].value

    fn = jax.shard_map(body, mesh=dp_mesh, in_specs=(P(), P("DP")), out_specs=P("DP"), check_vma=False)
    per_device = np.asarray(jax.jit(fn)(params, x)).reshape(n, 4)
    mean = -np.asarray(x).reshape(n, 4).mean(axis=0)
    assert np.allclose(per_device, mean), per_device  # every device stepped by the mean gradient
