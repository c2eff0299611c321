"""shard_map population helpers, keys, ranks and device placement against single-device references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj
from popmesh.core.errors import ConfigError

POP = 16  # two members per device


@pytest.fixture(scope="module")
def pop_mesh(devices):
    return Mesh(np.asarray(devices), (pj.POPULATION_AXIS,))


def member_fn(weights, shared, offset):
    """One member: weights (3,), shared (5, 3) replicated, offset scalar per member."""
    return shared @ weights + offset


def _inputs():
    weights = jnp.arange(POP * 3, dtype=jnp.float32).reshape(POP, 3) / 10
    shared = jnp.arange(15, dtype=jnp.float32).reshape(5, 3)
    offsets = jnp.arange(POP, dtype=jnp.float32)
    expected = np.stack([member_fn(w, shared, o) for w, o in zip(weights, offsets)])
    return weights, shared, offsets, expected


@pytest.mark.parametrize("helper", [pj.vmap_per_device, pj.map_per_device], ids=["vmap", "map"])
def test_replicated_argument_is_not_mapped(pop_mesh, helper):
    weights, shared, offsets, expected = _inputs()
    fn = helper(
        member_fn, pop_mesh, in_specs=(P("POP"), P(), P("POP")), out_specs=P("POP"), in_axes=(0, None, 0)
    )
    out = jax.jit(fn)(weights, shared, offsets)
    assert out.shape == (POP, 5)
    assert np.allclose(out, expected)


def test_map_per_device_moves_a_non_leading_mapped_axis(pop_mesh):
    weights, shared, offsets, expected = _inputs()
    fn = pj.map_per_device(
        member_fn, pop_mesh,
        in_specs=(P(None, "POP"), P(), P("POP")), out_specs=P("POP"), in_axes=(1, None, 0),
    )
    assert np.allclose(fn(weights.T, shared, offsets), expected)


def test_default_in_axes_maps_every_argument_like_evorl(pop_mesh):
    x = jnp.arange(POP, dtype=jnp.float32)
    for helper in (pj.vmap_per_device, pj.map_per_device):
        out = helper(lambda a, b: a * b, pop_mesh, in_specs=P("POP"), out_specs=P("POP"))(x, x + 1)
        assert np.allclose(out, x * (x + 1))


@pytest.mark.parametrize("in_axes", [(0,), (0, "x"), None])
def test_map_per_device_rejects_bad_in_axes(pop_mesh, in_axes):
    fn = pj.map_per_device(lambda a, b: a + b, pop_mesh, in_specs=P("POP"), out_specs=P("POP"), in_axes=in_axes)
    with pytest.raises(ConfigError, match="in_axes"):
        fn(jnp.ones(POP), jnp.ones(POP))


def test_check_rep_is_translated_to_check_vma(pop_mesh):
    with pytest.warns(DeprecationWarning, match="check_vma"):
        fn = pj.vmap_per_device(lambda a: a.sum(), pop_mesh, in_specs=P("POP"), out_specs=P(), check_rep=False)
    # Only legal without the replication check: a per-device value declared replicated.
    assert fn(jnp.ones((POP, 2))).shape == (2,)


@pytest.mark.parametrize("typed", [False, True])
def test_split_key_per_device_places_one_subkey_per_device(devices, typed):
    key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
    keys = pj.split_key_per_device(key, devices)
    assert keys.shape == (len(devices),) + key.shape
    assert keys.sharding.spec == P("devices")
    expected = jax.random.split(key, len(devices))
    raw = jax.random.key_data if typed else (lambda k: k)
    assert np.array_equal(raw(keys), raw(expected))
    for shard in keys.addressable_shards:
        index = shard.index[0].start
        assert shard.device == devices[index]


def test_split_keys_feed_shard_map_over_the_same_devices(devices):
    keys = pj.split_key_per_device(jax.random.key(0), devices, axis_name="DP")
    mesh = Mesh(np.asarray(devices), ("DP",))
    draws = jax.shard_map(
        lambda k: jax.random.uniform(k[0], (1,)), mesh=mesh, in_specs=P("DP"), out_specs=P("DP")
    )(keys)
    assert len(set(np.asarray(draws).tolist())) == len(devices)


def test_device_ranks_one_per_device(devices):
    ranks = pj.device_ranks()
    assert ranks.dtype == jnp.int32 and np.array_equal(ranks, np.arange(jax.device_count()))
    for shard in ranks.addressable_shards:
        assert int(shard.data[0]) == jax.devices().index(shard.device)
    subset = pj.device_ranks(devices[:4], axis_name="DP")
    assert subset.sharding.spec == P("DP") and np.array_equal(subset, np.arange(4))


def test_single_process_is_not_initialized():
    assert pj.is_initialized() is False
