"""Gradient-update wrappers: one optimiser step with gradients averaged over a data-parallel axis.

What EvoRL's ``gradient_update`` / ``agent_gradient_update`` do (themselves adapted from Brax; their
facades are in :mod:`popmesh.compat.evorl`), with two fixes: ``params`` is passed to
``optimizer.update`` so transforms that need it (``optax.adamw``, ``add_decayed_weights``) work,
and the agent variant accepts any loss arity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax

import jax
from popmesh.jax.axes import AxisName, as_varying, axis_names, require_bound
from popmesh.jax.fsdp import mean_grads

__all__ = ["loss_and_pgrad", "make_update", "make_agent_update", "attach_params", "detach_params"]

UpdateFn = Callable[..., tuple[Any, Any, Any]]


def loss_and_pgrad(
    loss_fn: Callable[..., Any], dp_axis_name: AxisName | None, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` whose gradients are averaged over ``dp_axis_name``.

    The value (loss, or ``(loss, aux)``) stays per-device, as in EvoRL. Inside
    ``shard_map(check_vma=True)`` the parameters are first marked varying so every device
    differentiates its own loss and the mean is exact (JAX would otherwise sum them). Averaging is
    :func:`popmesh.jax.mean_grads`, so FSDP parameters (``nn.Partitioned`` shards) are not
    averaged over the axes they are sharded on.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def wrapped(params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if dp_axis_name is None:
            return grad_fn(params, *args, **kwargs)
        require_bound(dp_axis_name, "make_update")
        value, grads = grad_fn(as_varying(params, dp_axis_name), *args, **kwargs)
        return value, mean_grads(grads, axis_names(dp_axis_name))

    return wrapped


def make_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    dp_axis_name: AxisName | None = None,
    has_aux: bool = False,
) -> UpdateFn:
    """Wrap ``loss_fn(params, *args, **kwargs)`` into one optimiser step.

    Returns ``f(opt_state, params, *args, **kwargs) -> (value, new_params, new_opt_state)`` where
    ``value`` is the loss or ``(loss, aux)`` with ``has_aux``. Gradients are averaged over
    ``dp_axis_name`` (every device of the axis must call ``f`` with replicated ``params`` and
    ``opt_state`` and its own data shard); ``None`` means one device. With equal shard sizes and a
    mean loss, the step equals the full-batch step on one device.
    """
    grad_fn = loss_and_pgrad(loss_fn, dp_axis_name, has_aux)

    def update(opt_state: Any, params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        value, grads = grad_fn(params, *args, **kwargs)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), new_opt_state

    return update


def attach_params(agent_state: Any, params: Any) -> Any:
    """A copy of ``agent_state`` whose ``params`` are ``params``; :func:`make_agent_update`'s default ``attach_fn``."""
    if hasattr(agent_state, "replace"):
        return agent_state.replace(params=params)
    if hasattr(agent_state, "_replace"):
        return agent_state._replace(params=params)
    if dataclasses.is_dataclass(agent_state) and not isinstance(agent_state, type):
        return dataclasses.replace(agent_state, params=params)
    if isinstance(agent_state, Mapping):
        return {**agent_state, "params": params}
    raise TypeError(
        f"cannot attach params to a {type(agent_state).__name__}: give it a `params` field "
        "(flax struct, dataclass, NamedTuple or dict) or pass attach_fn=/detach_fn="
    )


def detach_params(agent_state: Any) -> Any:
    """``agent_state``'s ``params`` (attribute or mapping key); :func:`make_agent_update`'s default ``detach_fn``."""
    if isinstance(agent_state, Mapping):
        return agent_state["params"]
    return agent_state.params


def make_agent_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    dp_axis_name: AxisName | None = None,
    has_aux: bool = False,
    attach_fn: Callable[[Any, Any], Any] = attach_params,
    detach_fn: Callable[[Any], Any] = detach_params,
) -> UpdateFn:
    """Like :func:`make_update` for a loss written against a whole agent state.

    ``loss_fn(agent_state, *args, **kwargs)`` with any arity; only ``detach_fn(agent_state)``
    (default ``agent_state.params``) is differentiated, other leaves are constants. Returns
    ``f(opt_state, agent_state, *args, **kwargs) -> (value, new_agent_state, new_opt_state)``.
    """

    def params_loss(params: Any, agent_state: Any, *args: Any, **kwargs: Any) -> Any:
        return loss_fn(attach_fn(agent_state, params), *args, **kwargs)

    update_params = make_update(params_loss, optimizer, dp_axis_name, has_aux)

    def update(opt_state: Any, agent_state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        params = detach_fn(agent_state)
        value, new_params, new_opt_state = update_params(
            opt_state, params, agent_state, *args, **kwargs
        )
        return value, attach_fn(agent_state, new_params), new_opt_state

    return update
