"""``xlstm_jax.distributed.data_parallel`` (xLSTM-jax FSDP inside ``shard_map``) over :mod:`popmesh.jax`.

Same names, parameters, order and defaults as the original; each function only passes its
arguments on to ``popmesh.jax``: ``shard_params`` → ``shard_tree``, ``gather_params`` →
``gather_tree``, ``shard_module_params`` → ``shard_module``, ``gather_array_with_mean_grads`` →
``gather_with_mean_grads``, ``sync_gradients`` → ``mean_grads``.

Sharding uses xLSTM's layout, ``tie_break="last"``: among dimensions of equal size the *last* is
sharded (a ``(d, d)`` kernel is split by columns).
popmesh's own default is ``"first"``, whose contiguous blocks made a square-kernel step about 3x
faster on CPU (``docs/jax.md``); call ``popmesh.jax.shard_tree`` directly for it, or for
``pad=True`` (padding indivisible tensors, which stay replicated here as in xLSTM).

Differences from xLSTM: a leaf left replicated because no dimension divides is logged at INFO
(xLSTM: WARNING), on logger ``popmesh.jax.fsdp``; the gather's gradient is a ``custom_vjp`` with
the same numbers as xLSTM's ``custom_gradient``; inside ``shard_map(check_vma=True)``,
``sync_gradients`` leaves alone a gradient that JAX already reduced over an axis (see
``popmesh.jax.as_varying``) instead of averaging it a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn

import jax
import popmesh.jax as _pj

__all__ = [
    "shard_params",
    "gather_array_with_mean_grads",
    "gather_params",
    "shard_module_params",
    "sync_gradients",
]

PyTree = Any


def shard_params(params: PyTree, axis_name: str, min_weight_size: int = 2**18) -> PyTree:
    """Shard parameters across the given mesh axis.

    Every leaf with more than ``min_weight_size`` values keeps this device's block of its largest
    dimension divisible by the axis size (the last of equal ones), as ``nn.Partitioned`` named
    with ``axis_name``; other leaves are returned as they are. Runs where ``axis_name`` is bound.
    """
    _pj.require_bound(axis_name, "shard_params")  # the error names this function
    return _pj.shard_tree(params, axis_name, min_weight_size, tie_break="last")


def gather_array_with_mean_grads(
    x: jax.Array, axis: int, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None
) -> jax.Array:
    """Gathering with averaging gradients across replicas.

    Tiled all-gather of ``x`` along ``axis`` (cast to ``gather_dtype`` first unless None); the
    gradient is the mean reduce-scatter, computed in ``grad_scatter_dtype`` (None: ``x.dtype``).
    """
    return _pj.gather_with_mean_grads(x, axis, axis_name, gather_dtype, grad_scatter_dtype)


def gather_params(
    params: PyTree, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None
) -> PyTree:
    """Gather parameters from all replicas across the given axis.

    ``nn.Partitioned`` leaves sharded over ``axis_name`` become full arrays (still ``Partitioned``
    when sharded over other axes too); other leaves are unchanged.
    """
    return _pj.gather_tree(params, axis_name, gather_dtype, grad_scatter_dtype)


def shard_module_params(
    target: type[nn.Module] | Callable[..., Any],
    axis_name: str,
    min_weight_size: int = 2**18,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> type[nn.Module] | Callable[..., Any]:
    """Shard parameters of a module across replicas.

    ``nn.map_variables`` over ``"params"``: stored sharded by :func:`shard_params` at init,
    gathered by :func:`gather_params` on every read inside the module.
    """
    return _pj.shard_module(
        target, axis_name, min_weight_size, gather_dtype, grad_scatter_dtype, tie_break="last"
    )


def sync_gradients(grads: PyTree, axis_names: Sequence[str]) -> PyTree:
    """Synchronize gradients across devices.

    Each gradient is averaged over the axes of ``axis_names`` its parameter is not partitioned
    over; a partitioned gradient already holds the mean along its own axes. Inside
    ``shard_map(check_vma=True)`` JAX's autodiff has already *summed* the gradients of replicated
    parameters, which are then returned as they are (axis size times the mean, as upstream): a
    RuntimeWarning says so at trace time. Differentiate with respect to
    ``popmesh.jax.as_varying(params, axis_names)`` (or use ``check_vma=False``) for the mean.
    """
    return _pj.mean_grads(grads, axis_names)
