"""Placing work on devices: ``shard_map`` + per-device ``vmap``/``map``, keys and ranks per device.

What EvoRL's ``shmap_vmap``/``shmap_map``/``split_key_to_devices``/``get_global_ranks`` do (their
facades are in :mod:`popmesh.compat.evorl`), on current JAX (``jax.shard_map``, ``NamedSharding``;
none of the removed device-put helpers, no private JAX state). :func:`vmap_per_device` and
:func:`map_per_device` gain ``in_axes`` so replicated arguments are not mapped, and translate EvoRL's
``check_rep=`` to ``check_vma=``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax
from popmesh.core.errors import ConfigError

__all__ = ["vmap_per_device", "map_per_device", "split_key_per_device", "device_ranks"]

InAxes = int | None | Sequence[Any]


def _shard_map_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Translate the removed ``check_rep=`` keyword (EvoRL passes it) to ``check_vma=``."""
    if "check_rep" in kwargs:
        warnings.warn(
            "check_rep= was renamed check_vma= in jax.shard_map; popmesh passes it on as check_vma=",
            DeprecationWarning,
            stacklevel=3,
        )
        kwargs = dict(kwargs)
        check_rep = kwargs.pop("check_rep")
        kwargs.setdefault("check_vma", check_rep)
    return kwargs


def vmap_per_device(
    fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    in_axes: InAxes = 0,
    out_axes: Any = 0,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``jax.shard_map`` whose per-device body is ``jax.vmap(fn, in_axes, out_axes)``.

    Every device vmaps ``fn`` over its local shard (e.g. its population members). Pass
    ``in_axes=(0, None)`` so an argument with spec ``P()`` is given whole to every call instead
    of being mapped. Positional arguments only; ``kwargs`` go to ``jax.shard_map``.
    """
    body = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_shard_map_kwargs(kwargs)
    )


def _per_arg_axes(in_axes: InAxes, n_args: int) -> tuple[int | None, ...]:
    if in_axes is None or isinstance(in_axes, int):
        return (in_axes,) * n_args
    axes = tuple(in_axes)
    if len(axes) != n_args or not all(a is None or isinstance(a, int) for a in axes):
        raise ConfigError(
            f"map_per_device: in_axes must be an int, None, or one int/None per positional argument "
            f"({n_args} given), got {in_axes!r}"
        )
    return axes


def _to_front(arg: Any, axis: int) -> Any:
    return arg if axis == 0 else jax.tree.map(lambda leaf: jnp.moveaxis(leaf, axis, 0), arg)


def map_per_device(
    fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    in_axes: InAxes = 0,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``jax.shard_map`` whose per-device body runs ``fn`` sequentially (``jax.lax.map``).

    Same contract as :func:`vmap_per_device` (outputs stacked on axis 0), but one local element at a
    time: less memory, more time. ``in_axes`` is one int/None for all positional arguments or one
    per argument; ``None`` passes the argument unmapped.
    """

    def body(*args: Any) -> Any:
        axes = _per_arg_axes(in_axes, len(args))
        mapped = tuple(_to_front(a, ax) for a, ax in zip(args, axes) if ax is not None)
        if not mapped:
            raise ConfigError("map_per_device: in_axes maps no argument; map at least one")

        def one(sliced: tuple[Any, ...]) -> Any:
            it = iter(sliced)
            return fn(*(a if ax is None else next(it) for a, ax in zip(args, axes)))

        return jax.lax.map(one, mapped)

    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_shard_map_kwargs(kwargs)
    )


def split_key_per_device(
    key: jax.Array, devices: Sequence[jax.Device], *, axis_name: str = "devices"
) -> jax.Array:
    """Split ``key`` into one sub-key per device: shape ``[len(devices), *key.shape]``.

    Row ``i`` lives on ``devices[i]`` (``NamedSharding`` over a 1-D mesh ``(axis_name,)``), so the
    result can be passed to ``shard_map`` with ``in_specs=P(axis_name)`` on a mesh of the same
    devices. Works with raw ``uint32`` keys and typed keys.
    """
    keys = jax.random.split(key, len(devices))
    mesh = Mesh(np.asarray(devices), (axis_name,))
    return jax.device_put(keys, NamedSharding(mesh, PartitionSpec(axis_name)))  # type: ignore[no-untyped-call]  # jax: PartitionSpec is unannotated


def device_ranks(
    devices: Sequence[jax.Device] | None = None, *, axis_name: str = "devices"
) -> jax.Array:
    """One int32 rank per device: ``ranks[i] == i`` lives on ``devices[i]``.

    ``devices`` defaults to ``jax.devices()`` (every process's devices, process-major), so in a
    multi-process run each device's rank is ``process_index * local_device_count + local_index``
    and the array is global (usable with a global mesh; EvoRL built it on local devices only).
    Every process must call this with the same ``devices``.
    """
    devices = list(jax.devices() if devices is None else devices)
    mesh = Mesh(np.asarray(devices), (axis_name,))
    sharding = NamedSharding(mesh, PartitionSpec(axis_name))  # type: ignore[no-untyped-call]  # jax: PartitionSpec is unannotated
    ranks = np.arange(len(devices), dtype=np.int32)
    return jax.make_array_from_callback(ranks.shape, sharding, lambda index: ranks[index])
