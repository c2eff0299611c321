"""Fully sharded data parallelism (ZeRO-3 style) for code that runs inside ``jax.shard_map``.

What ``xlstm_jax.distributed.data_parallel`` does (its facade is :mod:`popmesh.compat.xlstm_jax`):
parameters are stored as ``flax.linen.Partitioned`` shards along a mesh axis, all-gathered right
before a module uses them, and the gradient of that gather is a *mean* reduce-scatter. Arguments
keep xLSTM's order and defaults; additions are keyword-only (``pad=``, ``tie_break=``).

Names: :func:`shard_tree` / :func:`gather_tree` shard and gather a parameter tree,
:func:`shard_module` wraps a linen module in both, :func:`gather_with_mean_grads` is the one-array
gather, :func:`mean_grads` averages gradients over the axes a parameter is not sharded on.

Contract: every function here runs where ``axis_name`` is bound (inside ``shard_map`` over a mesh
with that axis); every device of the axis calls it with identically shaped parameters, and the full
values being sharded are the same on every device (same init key).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, PartitionSpec

import jax
from popmesh.core.errors import ConfigError
from popmesh.jax.axes import _checked, axis_size, require_bound, varying_axes

__all__ = [
    "PaddedPartitioned",
    "shard_tree",
    "gather_with_mean_grads",
    "gather_tree",
    "shard_module",
    "mean_grads",
    "sharded_init",
]

log = logging.getLogger(__name__)

PyTree = Any
Names = tuple[Any, ...]
TieBreak = Literal["first", "last"]


class PaddedPartitioned(nn.Partitioned[Any]):  # type: ignore[no-untyped-call]  # flax: PyTreeNode.__init_subclass__ is unannotated
    """A ``Partitioned`` shard of a parameter zero-padded along its sharded dimension.

    ``unpadded`` is the original length of that dimension; :func:`gather_tree` gathers the
    padded tensor and slices it back to ``unpadded``, so the padding never reaches the model and
    receives zero gradient.
    """

    unpadded: int = struct.field(default=0, pytree_node=False)  # type: ignore[no-untyped-call]  # flax: struct.field is unannotated


def _is_partitioned(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _flat_names(names: Names) -> set[str]:
    flat: set[str] = set()
    for name in names:
        if isinstance(name, str):
            flat.add(name)
        elif name is not None:
            flat.update(name)
    return flat


def _pick_dim(shape: tuple[int, ...], names: Names, n: int, pad: bool, tie_break: TieBreak) -> int | None:
    """Largest unnamed dim divisible by ``n`` (any unnamed dim with ``pad``); ties per ``tie_break``."""
    sign = 1 if tie_break == "last" else -1
    order = sorted(range(len(shape)), key=lambda d: (shape[d], sign * d), reverse=True)
    for dim in order:
        if names[dim] is None and (pad or shape[dim] % n == 0):
            return dim
    return None


def _shard_leaf(
    path: str, leaf: Any, axis_name: str, index: jax.Array, n: int, min_size: int, pad: bool,
    tie_break: TieBreak,
) -> Any:
    value = leaf.value if _is_partitioned(leaf) else leaf
    names = leaf.names if _is_partitioned(leaf) else (None,) * jnp.ndim(value)
    if axis_name in _flat_names(names):
        log.warning("shard_tree: %s is already sharded over %r; left as is", path, axis_name)
        return leaf
    if value.size <= min_size:
        log.debug("shard_tree: %s replicated: size %d <= min_weight_size %d", path, value.size, min_size)
        return leaf
    dim = _pick_dim(value.shape, names, n, False, tie_break)
    unpadded = None
    if dim is None and pad:
        dim = _pick_dim(value.shape, names, n, True, tie_break)
        if dim is not None:
            unpadded = value.shape[dim]
            widths = [(0, 0)] * value.ndim
            widths[dim] = (0, -unpadded % n)
            value = jnp.pad(value, widths)
    if dim is None:
        log.info("shard_tree: %s replicated: no free dim of %s divisible by %d (pad=True pads one)",
                 path, value.shape, n)
        return leaf
    chunk = value.shape[dim] // n
    local = jax.lax.dynamic_slice_in_dim(value, index * chunk, chunk, axis=dim)
    new_names = names[:dim] + (axis_name,) + names[dim + 1:]
    mesh = leaf.mesh if _is_partitioned(leaf) else None
    if unpadded is not None:
        return PaddedPartitioned(local, new_names, mesh, unpadded=unpadded)
    return nn.Partitioned(local, new_names, mesh)


def shard_tree(
    params: PyTree,
    axis_name: str,
    min_weight_size: int = 2**18,
    *,
    pad: bool = False,
    tie_break: TieBreak = "first",
) -> PyTree:
    """Keep only this device's block of every large parameter, as ``nn.Partitioned``.

    For each leaf (a ``Partitioned`` counts as one) with more than ``min_weight_size`` values, the
    dimension sharded is the largest one not already named whose size divides by the axis size.
    Among equal sizes the *first* dimension wins by default: its blocks are contiguous in memory,
    which made a square-kernel MLP step 3x faster on CPU (``benchmarks/jax_fsdp.py``);
    ``tie_break="last"`` gives xLSTM's layout (``(8, 8)`` shards dim 1). Device ``i`` keeps block ``i``.

    Small or indivisible leaves stay replicated and the reason is logged (``logging``, logger
    ``popmesh.jax.fsdp``; debug for small, info for indivisible). With ``pad=True`` an indivisible
    leaf is zero-padded along its largest free dimension to a multiple of the axis size and stored
    as :class:`PaddedPartitioned`; :func:`gather_tree` trims it back.
    """
    if tie_break not in ("first", "last"):
        raise ConfigError(f"shard_tree: tie_break must be 'first' or 'last', got {tie_break!r}")
    require_bound(axis_name, "shard_tree")  # the error names this function, not a helper
    n = axis_size(axis_name)
    with jax.named_scope("shard_tree"):
        index = jax.lax.axis_index(axis_name)
        shard = lambda path, leaf: _shard_leaf(  # noqa: E731
            jax.tree_util.keystr(path), leaf, axis_name, index, n, min_weight_size, pad, tie_break
        )
        return jax.tree_util.tree_map_with_path(shard, params, is_leaf=_is_partitioned)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather(
    x: jax.Array, axis: int, axis_name: str, gather_dtype: Any, scatter_dtype: Any, dtype: Any
) -> jax.Array:
    return jax.lax.all_gather(x.astype(gather_dtype), axis_name, axis=axis, tiled=True)


def _gather_fwd(
    x: jax.Array, axis: int, axis_name: str, gather_dtype: Any, scatter_dtype: Any, dtype: Any
) -> tuple[jax.Array, None]:
    return _gather(x, axis, axis_name, gather_dtype, scatter_dtype, dtype), None


def _gather_bwd(
    axis: int, axis_name: str, gather_dtype: Any, scatter_dtype: Any, dtype: Any, _: None, ct: jax.Array
) -> tuple[jax.Array]:
    n = jax.lax.axis_size(axis_name)
    scattered = jax.lax.psum_scatter(ct.astype(scatter_dtype), axis_name, scatter_dimension=axis, tiled=True)  # type: ignore[no-untyped-call]  # jax: lax.psum_scatter is unannotated
    return ((scattered / n).astype(dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_with_mean_grads(
    x: jax.Array, axis: int, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None
) -> jax.Array:
    """All-gather ``x`` along ``axis`` (tiled); its gradient is the *mean* reduce-scatter.

    Forward: cast to ``gather_dtype`` (None: no cast), tiled ``all_gather``. Backward: cast the
    cotangent to ``grad_scatter_dtype`` (None: ``x.dtype``), tiled ``psum_scatter``, divide by the
    axis size, cast to ``x.dtype``. Averaging is built in, so each device's loss must be a mean
    over its own shard of the batch for the result to equal the global mean gradient.
    """
    require_bound(axis_name, "gather_with_mean_grads")
    gather_dtype = jnp.dtype(x.dtype if gather_dtype is None else gather_dtype)
    scatter_dtype = jnp.dtype(x.dtype if grad_scatter_dtype is None else grad_scatter_dtype)
    with jax.named_scope("gather_with_mean_grads"):
        return _gather(x, axis, axis_name, gather_dtype, scatter_dtype, jnp.dtype(x.dtype))


def _gather_leaf(leaf: Any, axis_name: str, gather_dtype: Any, scatter_dtype: Any) -> Any:
    if not _is_partitioned(leaf) or axis_name not in leaf.names:
        return leaf
    dim = leaf.names.index(axis_name)
    full = gather_with_mean_grads(leaf.value, dim, axis_name, gather_dtype, scatter_dtype)
    if isinstance(leaf, PaddedPartitioned):
        full = jax.lax.slice_in_dim(full, 0, leaf.unpadded, axis=dim)
    names = leaf.names[:dim] + (None,) + leaf.names[dim + 1:]
    if all(name is None for name in names):
        return full
    return nn.Partitioned(full, names, leaf.mesh)


def gather_tree(
    params: PyTree, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None
) -> PyTree:
    """Gather every ``Partitioned`` leaf sharded over ``axis_name`` into the full tensor.

    A leaf whose names only held ``axis_name`` becomes a raw array; one still sharded over other
    axes (e.g. tensor-parallel) stays ``Partitioned`` with those names. Other leaves are unchanged.
    Padded leaves (:class:`PaddedPartitioned`) are trimmed back to their original size.
    Gradients flow back as the mean over the axis (see :func:`gather_with_mean_grads`).
    """
    with jax.named_scope("gather_tree"):
        gather = lambda leaf: _gather_leaf(leaf, axis_name, gather_dtype, grad_scatter_dtype)  # noqa: E731
        return jax.tree.map(gather, params, is_leaf=_is_partitioned)


def shard_module(
    target: type[nn.Module] | Callable[..., Any],
    axis_name: str,
    min_weight_size: int = 2**18,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
    *,
    pad: bool = False,
    tie_break: TieBreak = "first",
) -> type[nn.Module] | Callable[..., Any]:
    """Wrap a flax linen module class so its ``params`` are stored sharded over ``axis_name``.

    ``nn.map_variables`` on the ``"params"`` collection: parameters written at init pass through
    :func:`shard_tree`, every read inside the module through :func:`gather_tree`. Apply it
    *before* ``nn.remat`` so gathered tensors are re-gathered, not saved, for the backward pass.
    Init and apply must both run inside ``shard_map`` over a mesh with ``axis_name``. ``pad`` and
    ``tie_break`` are passed to :func:`shard_tree`.
    """
    return nn.map_variables(
        target,
        mapped_collections="params",
        trans_in_fn=functools.partial(
            gather_tree, axis_name=axis_name, gather_dtype=gather_dtype,
            grad_scatter_dtype=grad_scatter_dtype,
        ),
        trans_out_fn=functools.partial(
            shard_tree, axis_name=axis_name, min_weight_size=min_weight_size, pad=pad,
            tie_break=tie_break,
        ),
        mutable=True,
    )


_SUMMED_WARNING = (
    "mean_grads: inside shard_map(check_vma=True), JAX's autodiff already SUMMED the gradients of "
    "parameters replicated along {axes} over the devices: they are returned as they are, {axes} size "
    "times the mean (upstream xlstm-jax's sync_gradients does the same). For the mean, differentiate "
    "with respect to popmesh.jax.as_varying(params, axis_names), or run shard_map with check_vma=False."
)


def _sync_value(value: jax.Array, axes: tuple[str, ...], checked: frozenset[str]) -> jax.Array:
    # Under check_vma, a gradient invariant along a checked axis was already reduced by JAX.
    vary = varying_axes(value)
    summed = tuple(a for a in axes if a in checked and a not in vary)
    if summed:  # once per call site and trace (Python's default warning filter)
        warnings.warn(_SUMMED_WARNING.format(axes=summed), RuntimeWarning, stacklevel=4)
    axes = tuple(a for a in axes if a not in checked or a in vary)
    return jax.lax.pmean(value, axes) if axes else value  # type: ignore[no-untyped-call]  # jax: lax.pmean is unannotated


def mean_grads(grads: PyTree, axis_names: Sequence[str]) -> PyTree:
    """Average gradients over the axes of ``axis_names`` a parameter is *not* sharded on.

    A ``Partitioned`` gradient sharded over an axis already holds the mean along it (the gather's
    backward), so only its other axes are averaged; plain arrays are averaged over all of them.
    Inside ``shard_map(check_vma=True)`` a gradient that JAX typed as invariant along an axis was
    already reduced by autodiff and is left alone: differentiate with respect to
    ``popmesh.jax.as_varying(params, axis_names)`` to get per-device gradients that this averages.
    """
    names = tuple(axis_names)
    require_bound(names, "mean_grads")
    checked = frozenset(name for name in names if _checked(name))

    def sync(leaf: Any) -> Any:
        if _is_partitioned(leaf):
            sharded = _flat_names(leaf.names)
            axes = tuple(a for a in names if a not in sharded)
            return leaf.replace(value=_sync_value(leaf.value, axes, checked))
        return _sync_value(leaf, names, checked)

    with jax.named_scope("mean_grads"):
        return jax.tree.map(sync, grads, is_leaf=_is_partitioned)


def sharded_init(
    init_fn: Callable[..., PyTree], mesh: Mesh, in_specs: Any, *args: Any, check_vma: bool = True
) -> tuple[PyTree, PyTree]:
    """Run ``init_fn(*args)`` inside ``shard_map`` and return ``(params, partition_specs)``.

    The specs come from the ``Partitioned`` names that :func:`shard_tree` wrote (``P()`` for
    replicated leaves), found by a shape-only trace, so the returned global arrays hold each
    device's shard and can be passed back to ``shard_map`` with ``in_specs=partition_specs``.
    """
    probe = jax.shard_map(init_fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=False)  # type: ignore[no-untyped-call]  # jax: PartitionSpec is unannotated
    specs = nn.get_partition_spec(jax.eval_shape(probe, *args))
    init = jax.shard_map(init_fn, mesh=mesh, in_specs=in_specs, out_specs=specs, check_vma=check_vma)
    return jax.jit(init)(*args), specs
