"""``evorl.distributed`` (EvoRL, the generation with ``DP_AXIS_NAME``) over :mod:`popmesh.jax`.

Same names, parameters, order and defaults as the original; each function only passes its
arguments on to ``popmesh.jax`` (or to JAX itself). Map: ``DP_AXIS_NAME``/``POP_AXIS_NAME`` →
``DATA_AXIS``/``POPULATION_AXIS``; ``gradient_update``/``agent_gradient_update`` →
``make_update``/``make_agent_update``; ``shmap_vmap``/``shmap_map`` →
``vmap_per_device``/``map_per_device``; ``split_key_to_devices`` → ``split_key_per_device``;
``get_global_ranks`` → ``device_ranks``; ``is_dist_initialized`` → ``is_initialized``;
``tree_device_put`` → ``jax.device_put``; ``get_process_id`` → ``jax.process_index``.

Where popmesh deliberately behaves differently from EvoRL:

* a collective naming an axis that no ``shard_map``/``vmap`` binds raises
  ``popmesh.jax.UnboundAxisError`` (a ``NameError``) saying how to bind it, instead of JAX's bare
  ``NameError: unbound axis name``;
* ``all_gather(x, None)`` untiled inserts the size-1 gathered axis, so shapes do not depend on the
  device count (EvoRL returned ``x``);
* ``gradient_update`` / ``agent_gradient_update`` pass ``params`` to ``optimizer.update``, so
  ``optax.adamw`` and ``add_decayed_weights`` work (EvoRL raised ``ValueError``), average exactly
  under ``shard_map(check_vma=True)``, and the agent loss may take any arguments;
* ``shmap_vmap`` / ``shmap_map`` use ``jax.shard_map`` and translate ``check_rep=`` to
  ``check_vma=`` with a ``DeprecationWarning`` (EvoRL's ``check_rep=`` is a ``TypeError`` there);
* keys and ranks are placed with ``NamedSharding`` (no removed ``device_put_sharded``), process
  state comes from public JAX APIs (no ``jax._src`` state), and ``get_global_ranks`` returns one
  global array over ``jax.devices()``, usable with a global mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optax

import jax
import popmesh.jax as _pj
from popmesh.jax.updates import attach_params as _attach_params_to_agent_state
from popmesh.jax.updates import detach_params as _detach_params_to_agent_state

__all__ = [
    "DP_AXIS_NAME",
    "POP_AXIS_NAME",
    "agent_gradient_update",
    "all_gather",
    "get_global_ranks",
    "get_process_id",
    "gradient_update",
    "is_dist_initialized",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "shmap_map",
    "shmap_vmap",
    "split_key_to_devices",
    "tree_device_put",
]

UpdateFn = Callable[..., tuple[Any, Any, Any]]

DP_AXIS_NAME = _pj.DATA_AXIS
"""Data-parallel axis name (``"DP"``)."""
POP_AXIS_NAME = _pj.POPULATION_AXIS
"""Population axis name (``"POP"``)."""


def pmean(x: Any, axis_name: str | None = None) -> Any:
    """Mean of every leaf of ``x`` over ``axis_name``; ``x`` itself when it is None."""
    return _pj.pmean(x, axis_name)


def psum(x: Any, axis_name: str | None = None) -> Any:
    """Sum of every leaf of ``x`` over ``axis_name``; ``x`` itself when it is None."""
    return _pj.psum(x, axis_name)


def pmin(x: Any, axis_name: str | None = None) -> Any:
    """Minimum of every leaf of ``x`` over ``axis_name``; ``x`` itself when it is None."""
    return _pj.pmin(x, axis_name)


def pmax(x: Any, axis_name: str | None = None) -> Any:
    """Maximum of every leaf of ``x`` over ``axis_name``; ``x`` itself when it is None."""
    return _pj.pmax(x, axis_name)


def all_gather(x: Any, axis_name: str | None = None, **kwargs: Any) -> Any:
    """All-gather the data across all devices (``kwargs``: ``axis``, ``tiled``, ...).

    Differs from EvoRL with ``axis_name=None`` and ``tiled=False``: a size-1 axis is inserted at
    ``axis`` (EvoRL returned ``x``), so the result has the same rank on one device as on many.
    """
    return _pj.all_gather(x, axis_name, **kwargs)


def get_global_ranks() -> jax.Array:
    """Return the global rank for each device: an int32 array, one unique rank per device.

    Rank ``process_index * local_device_count + local_index``, as in EvoRL; popmesh builds one
    global array over ``jax.devices()`` (EvoRL: a per-process array over the local devices).
    """
    return _pj.device_ranks()


def get_process_id() -> int:
    """Return the node id in multi-node distributed env (``jax.process_index()``; 0 alone)."""
    return int(jax.process_index())


def is_dist_initialized() -> bool:
    """Whether JAX's distributed setting is initialized (public ``jax.distributed`` API)."""
    return _pj.is_initialized()


def gradient_update(
    loss_fn: Callable[..., float],
    optimizer: optax.GradientTransformation,
    dp_axis_name: str | None,
    has_aux: bool = False,
) -> UpdateFn:
    """Wrapper of the loss function that apply gradient updates.

    Returns ``f(opt_state, params, *args, **kwargs) -> (value, new_params, new_opt_state)``;
    gradients of ``loss_fn(params, *args, **kwargs)`` are averaged over ``dp_axis_name`` (None:
    one device), every leaf as in EvoRL, ``nn.Partitioned`` ones included (popmesh's own
    ``make_update`` leaves FSDP shards alone along the axes they are sharded on); ``value`` is the
    loss, or ``(loss, aux)`` with ``has_aux``. Fixed: ``params`` reaches ``optimizer.update``
    (``optax.adamw`` works); under ``shard_map(check_vma=True)`` the mean is exact (JAX's autodiff
    would otherwise sum replicated parameters' gradients first).
    """
    if dp_axis_name is None:
        return _pj.make_update(loss_fn, optimizer, None, has_aux)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def update(opt_state: Any, params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        value, grads = grad_fn(_pj.as_varying(params, dp_axis_name), *args, **kwargs)
        grads = jax.tree.map(lambda g: _pj.pmean(g, dp_axis_name), grads)  # every leaf, as EvoRL
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), new_opt_state

    return update


def agent_gradient_update(
    loss_fn: Callable[..., float],
    optimizer: optax.GradientTransformation,
    dp_axis_name: str | None = None,
    has_aux: bool = False,
    attach_fn: Callable[[Any, Any], Any] = _attach_params_to_agent_state,
    detach_fn: Callable[[Any], Any] = _detach_params_to_agent_state,
) -> UpdateFn:
    """``gradient_update`` for ``loss_fn(agent_state, sample_batch, key)``; only the params train.

    Returns ``f(opt_state, agent_state, *args, **kwargs) -> (value, new_agent_state,
    new_opt_state)``. ``detach_fn(agent_state)`` (default ``agent_state.params``) is differentiated
    and ``attach_fn(agent_state, params)`` puts new params back. Fixed: ``params`` reaches
    ``optimizer.update``; the loss may take any arguments; ``detach_fn`` takes one argument (EvoRL's
    type hint said two).
    """
    return _pj.make_agent_update(loss_fn, optimizer, dp_axis_name, has_aux, attach_fn, detach_fn)


def shmap_map(fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any, **kwargs: Any) -> Callable[..., Any]:
    """Sequential execution on different gpu: ``jax.shard_map`` whose body runs ``fn`` over the
    leading axis of each device's positional arguments with ``jax.lax.map``.

    ``kwargs`` go to ``jax.shard_map``; ``check_rep=`` becomes ``check_vma=`` (with a warning).
    """
    return _pj.map_per_device(fn, mesh, in_specs, out_specs, **kwargs)


def shmap_vmap(fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any, **kwargs: Any) -> Callable[..., Any]:
    """Vmap on different gpu: ``jax.shard_map`` whose body is ``jax.vmap(fn)`` over each device's shard.

    ``kwargs`` go to ``jax.shard_map``; ``check_rep=`` becomes ``check_vma=`` (with a warning).
    """
    return _pj.vmap_per_device(fn, mesh, in_specs, out_specs, **kwargs)


def split_key_to_devices(key: jax.Array, devices: Sequence[jax.Device]) -> jax.Array:
    """Split the key to each device: shape ``[len(devices), *key.shape]``, row i on ``devices[i]``."""
    return _pj.split_key_per_device(key, devices)


def tree_device_put(tree: Any, device_or_sharding: Any) -> Any:
    """Pytree version of jax.device_put (one ``jax.device_put`` call for the whole tree)."""
    return jax.device_put(tree, device_or_sharding)
