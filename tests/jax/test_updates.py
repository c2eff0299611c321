"""make_update / make_agent_update: data-parallel steps equal the full-batch step."""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax
import popmesh.jax as pj

BATCH = 32


def _problem():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (4, 2)), "b": jnp.zeros(2)}
    x = jax.random.normal(k2, (BATCH, 4))
    true_w = jnp.array([[1.0, -1.0], [2.0, 0.5], [0.0, 1.0], [-1.0, 3.0]])
    y = x @ true_w + 0.1 * jax.random.normal(k3, (BATCH, 2))
    return params, x, y


def mse(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _reference(optimizer, params, x, y, steps):
    """Plain optax on one device with the whole batch (params passed to update)."""
    state = optimizer.init(params)
    for _ in range(steps):
        loss, grads = jax.value_and_grad(mse)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return loss, params


def _dp_run(optimizer, params, x, y, steps, mesh, axes, check_vma):
    step = pj.make_update(mse, optimizer, dp_axis_name=axes)

    def body(opt_state, params, x, y):
        for _ in range(steps):
            loss, params, opt_state = step(opt_state, params, x, y)
        return pj.pmean(loss, axes), params

    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(axes), P(axes)), out_specs=(P(), P()), check_vma=check_vma
    )
    return jax.jit(fn)(optimizer.init(params), params, x, y)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    ("optimizer", "mesh_name", "axes"),
    [
        (optax.sgd(0.1), "dp_mesh", "DP"),
        (optax.adamw(0.05, weight_decay=0.1), "dp_mesh", "DP"),
        (optax.adamw(0.05, weight_decay=0.1), "grid_mesh", ("POP", "DP")),
    ],
    ids=["sgd-DP", "adamw-DP", "adamw-POPxDP"],
)
def test_dp_update_equals_full_batch_update(request, optimizer, mesh_name, axes, check_vma):
    params, x, y = _problem()
    mesh = request.getfixturevalue(mesh_name)
    loss, new_params = _dp_run(optimizer, params, x, y, 3, mesh, axes, check_vma)
    ref_loss, ref_params = _reference(optimizer, params, x, y, 3)
    assert np.allclose(loss, ref_loss, rtol=1e-5)
    for key in params:
        assert np.allclose(new_params[key], ref_params[key], rtol=1e-5, atol=1e-6)
    assert not np.allclose(new_params["w"], params["w"])


def test_single_device_update_with_adamw_and_aux():
    params, x, y = _problem()
    optimizer = optax.adamw(0.05, weight_decay=0.1)

    def loss_with_aux(params, x, y):
        loss = mse(params, x, y)
        return loss, {"twice": 2 * loss}

    step = jax.jit(pj.make_update(loss_with_aux, optimizer, has_aux=True))
    (loss, aux), new_params, _ = step(optimizer.init(params), params, x, y)
    ref_loss, ref_params = _reference(optimizer, params, x, y, 1)
    assert np.allclose(loss, ref_loss) and np.allclose(aux["twice"], 2 * ref_loss)
    assert np.allclose(new_params["w"], ref_params["w"], rtol=1e-6)


def test_dp_update_under_vmap_axis_is_the_batch_mean():
    params, x, y = _problem()
    step = pj.make_update(mse, optax.sgd(0.1), dp_axis_name="V")
    opt_state = optax.sgd(0.1).init(params)
    _, new_params, _ = jax.vmap(step, in_axes=(None, None, 0, 0), axis_name="V")(
        opt_state, params, x[:, None], y[:, None]
    )
    _, ref_params = _reference(optax.sgd(0.1), params, x, y, 1)
    assert np.allclose(new_params["w"][5], ref_params["w"], rtol=1e-5)


def test_unbound_dp_axis_is_reported():
    params, x, y = _problem()
    step = pj.make_update(mse, optax.sgd(0.1), dp_axis_name="DP")
    with pytest.raises(pj.UnboundAxisError, match="make_update: axis 'DP'"):
        jax.jit(step)(optax.sgd(0.1).init(params), params, x, y)


@flax.struct.dataclass
class AgentState:
    params: dict
    obs_mean: jax.Array


class TupleState(NamedTuple):
    params: dict
    obs_mean: jax.Array


def _field(agent_state, name):
    return agent_state[name] if isinstance(agent_state, dict) else getattr(agent_state, name)


def agent_loss(agent_state, batch, key, *, scale=1.0):
    """Four-argument loss (EvoRL fixed the arity at three) using a non-trained agent leaf."""
    x, y = batch
    noise = 0.0 * jax.random.normal(key, ())
    return scale * mse(_field(agent_state, "params"), x - _field(agent_state, "obs_mean"), y) + noise


@pytest.mark.parametrize("kind", [AgentState, TupleState, dict])
def test_make_agent_update_over_dp_equals_full_batch(dp_mesh, kind):
    params, x, y = _problem()
    obs_mean = jnp.full((4,), 0.5)
    agent = kind(params=params, obs_mean=obs_mean)
    optimizer = optax.adamw(0.05, weight_decay=0.1)
    step = pj.make_agent_update(agent_loss, optimizer, dp_axis_name="DP")

    def body(opt_state, agent, x, y, key):
        loss, agent, opt_state = step(opt_state, agent, (x, y), key, scale=2.0)
        return pj.pmean(loss, "DP"), agent

    fn = jax.shard_map(body, mesh=dp_mesh, in_specs=(P(), P(), P("DP"), P("DP"), P()), out_specs=(P(), P()))
    loss, new_agent = jax.jit(fn)(optimizer.init(params), agent, x, y, jax.random.key(1))
    ref_optimizer = optax.adamw(0.05, weight_decay=0.1)
    grads = jax.grad(lambda p: 2.0 * mse(p, x - obs_mean, y))(params)
    updates, _ = ref_optimizer.update(grads, ref_optimizer.init(params), params)
    ref_params = optax.apply_updates(params, updates)
    assert np.allclose(loss, 2.0 * mse(params, x - obs_mean, y), rtol=1e-5)
    assert np.allclose(_field(new_agent, "obs_mean"), obs_mean)
    assert np.allclose(_field(new_agent, "params")["w"], ref_params["w"], rtol=1e-5, atol=1e-6)


def test_make_agent_update_custom_attach_and_detach():
    params, x, y = _problem()
    agent = {"net": params, "frozen": jnp.ones(())}
    step = pj.make_agent_update(
        lambda state, x, y: mse(state["net"], x, y) * state["frozen"],
        optax.sgd(0.1),
        attach_fn=lambda state, p: {**state, "net": p},
        detach_fn=lambda state: state["net"],
    )
    _, new_agent, _ = step(optax.sgd(0.1).init(params), agent, x, y)
    _, ref_params = _reference(optax.sgd(0.1), params, x, y, 1)
    assert np.allclose(new_agent["net"]["w"], ref_params["w"], rtol=1e-6)
    assert new_agent["frozen"] is agent["frozen"]


def test_default_attach_rejects_states_it_cannot_copy():
    class Bare:
        def __init__(self, params):
            self.params = params

    params, x, y = _problem()
    step = pj.make_agent_update(lambda s, x, y: mse(s.params, x, y), optax.sgd(0.1))
    with pytest.raises(TypeError, match="attach_fn=/detach_fn="):
        step(optax.sgd(0.1).init(params), Bare(params), x, y)
