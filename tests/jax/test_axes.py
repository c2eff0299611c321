"""Axis-optional collectives against numpy: rank r contributes r + 1."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj
from popmesh.core.errors import ConfigError

N = 8
RANK_PLUS_ONE = np.arange(1, N + 1, dtype=np.float32)


def _per_device(fn, mesh, out_specs=P(), check_vma=True):
    """Run ``fn(local_tree)`` on a tree whose device r holds r + 1 (shape (1,) and (1, 2))."""
    tree = {"a": jnp.asarray(RANK_PLUS_ONE), "b": (jnp.asarray(RANK_PLUS_ONE)[:, None] * jnp.ones((1, 2)),)}
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("DP"), out_specs=out_specs, check_vma=check_vma)
    return jax.jit(mapped)(tree)


@pytest.mark.parametrize(
    ("op", "reference"),
    [(pj.pmean, np.mean), (pj.psum, np.sum), (pj.pmin, np.min), (pj.pmax, np.max)],
)
def test_reductions_match_numpy_over_pytrees(dp_mesh, op, reference):
    out = _per_device(lambda t: op(t, pj.DATA_AXIS), dp_mesh)
    assert np.allclose(out["a"], reference(RANK_PLUS_ONE))
    assert np.allclose(out["b"][0], np.full((1, 2), reference(RANK_PLUS_ONE)))


@pytest.mark.parametrize("op", [pj.pmean, pj.psum, pj.pmin, pj.pmax])
def test_none_axis_is_identity(op):
    tree = {"x": jnp.arange(3.0), "y": [jnp.ones((2, 2))]}
    assert op(tree, None) is tree
    assert op(tree) is tree


def test_all_gather_tiled_and_untiled(dp_mesh):
    tiled = _per_device(lambda t: pj.all_gather(t["a"], "DP", tiled=True), dp_mesh, check_vma=False)
    untiled = _per_device(lambda t: pj.all_gather(t["b"][0], "DP"), dp_mesh, check_vma=False)
    assert np.array_equal(tiled, RANK_PLUS_ONE)
    assert untiled.shape == (N, 1, 2)
    assert np.array_equal(untiled[:, 0, 0], RANK_PLUS_ONE)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_untiled_all_gather_shape_is_the_same_on_one_device(dp_mesh, axis):
    local = jnp.ones((3, 2))
    single = pj.all_gather({"w": local}, None, axis=axis)["w"]
    gather = lambda x: pj.all_gather(x, "DP", axis=axis)  # noqa: E731
    many = jax.shard_map(gather, mesh=dp_mesh, in_specs=P(), out_specs=P(), check_vma=False)(local)
    pos = axis % 3
    assert many.shape[pos] == N
    assert single.shape == many.shape[:pos] + (1,) + many.shape[pos + 1:]
    assert pj.all_gather(local, None, tiled=True) is local


@pytest.mark.parametrize("op", [pj.pmean, pj.psum, pj.pmin, pj.pmax, pj.all_gather])
def test_unbound_axis_raises_a_popmesh_error_that_says_how_to_bind(op):
    with pytest.raises(pj.UnboundAxisError) as info:
        jax.jit(lambda x: op(x, "DP"))(jnp.ones(2))
    message = str(info.value)
    assert "'DP'" in message and "shard_map" in message and "vmap(..., axis_name='DP')" in message
    assert op.__name__ in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, NameError)


def test_bound_by_a_different_name_still_raises(dp_mesh):
    fn = jax.shard_map(lambda x: pj.psum(x, "POP"), mesh=dp_mesh, in_specs=P("DP"), out_specs=P("DP"))
    with pytest.raises(pj.UnboundAxisError, match="'POP'"):
        fn(jnp.ones(N))


def test_collectives_work_under_vmap_axis_names():
    x = jnp.asarray(RANK_PLUS_ONE)
    out = jax.vmap(lambda v: (pj.pmean(v, "V"), pj.all_gather(v, "V")), axis_name="V")(x)
    assert np.allclose(out[0], RANK_PLUS_ONE.mean())
    assert np.array_equal(out[1][3], RANK_PLUS_ONE)


def test_tuple_of_axes_reduces_over_the_whole_grid(grid_mesh):
    fn = jax.shard_map(
        lambda x: (pj.psum(x, ("POP", "DP")), pj.axis_size(("POP", "DP")), pj.axis_size(None)),
        mesh=grid_mesh, in_specs=P(("POP", "DP")), out_specs=P(),
    )
    total, size, one = fn(jnp.asarray(RANK_PLUS_ONE))
    assert np.allclose(total, RANK_PLUS_ONE.sum()) and int(size) == N and int(one) == 1


def test_as_varying_marks_only_missing_axes(grid_mesh):
    seen = {}

    def body(replicated, sharded):
        seen["before"] = pj.varying_axes(replicated), pj.varying_axes(sharded)
        r, s = pj.as_varying((replicated, sharded), ("POP", "DP"))
        seen["after"] = pj.varying_axes(r), pj.varying_axes(s)
        return pj.psum(r, ("POP", "DP")) + pj.psum(s, ("POP", "DP"))

    fn = jax.shard_map(body, mesh=grid_mesh, in_specs=(P(), P("DP")), out_specs=P())
    out = fn(jnp.ones(1), jnp.ones(4))
    assert seen["before"] == (frozenset(), frozenset({"DP"}))
    assert seen["after"] == (frozenset({"POP", "DP"}),) * 2
    assert np.allclose(out, 2 * N)


def test_as_varying_is_identity_without_vma_checks(dp_mesh):
    tree = {"w": jnp.ones(2)}
    assert pj.as_varying(tree, None) is tree
    seen = []
    fn = jax.shard_map(
        lambda t: seen.append(pj.as_varying(t, "DP") is t) or t,
        mesh=dp_mesh, in_specs=P(), out_specs=P(), check_vma=False,
    )
    fn(tree)
    assert seen == [True]
