"""Axis names and axis-optional collectives for code that runs inside ``shard_map`` or ``vmap``.

The convention (from EvoRL): write the training step once and pass ``axis_name=None`` on a single
device, a mesh axis name inside ``jax.shard_map``. With ``None`` every collective here is the
identity (``all_gather`` adds the gathered axis, so shapes never depend on the device count). With a
name, the JAX collective runs over every leaf of the pytree; a name that no enclosing transform
binds raises :class:`UnboundAxisError`, which says how to bind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax.numpy as jnp

import jax
from popmesh.core.errors import ConfigError

__all__ = [
    "DATA_AXIS",
    "POPULATION_AXIS",
    "AxisName",
    "UnboundAxisError",
    "axis_names",
    "axis_size",
    "require_bound",
    "pmean",
    "psum",
    "pmin",
    "pmax",
    "all_gather",
    "varying_axes",
    "as_varying",
]

DATA_AXIS = "DP"
"""Data-parallel axis: environments, minibatches and gradients are split / averaged along it."""
POPULATION_AXIS = "POP"
"""Population axis: population members (PBT agents, EC candidates) are split along it."""

AxisName: TypeAlias = str | tuple[str, ...]


class UnboundAxisError(ConfigError, NameError):
    """A collective named an axis that no enclosing ``shard_map``/``vmap`` binds.

    Also a ``NameError`` so code written against JAX's own unbound-axis error keeps working.
    """


def axis_names(axis_name: AxisName | Sequence[str] | None) -> tuple[str, ...]:
    """Normalise ``None`` / one name / several names to a tuple of names (``None`` → ``()``)."""
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        return (axis_name,)
    return tuple(axis_name)


def _bound_size(name: str, op: str) -> int:
    try:
        return int(jax.lax.axis_size(name))
    except NameError as e:
        raise UnboundAxisError(
            f"{op}: axis {name!r} is not bound here. Call this inside "
            f"jax.shard_map(..., mesh=Mesh(devices, ({name!r}, ...))) or "
            f"jax.vmap(..., axis_name={name!r}); pass axis_name=None on a single device."
        ) from e


def require_bound(axis_name: AxisName | Sequence[str] | None, op: str = "collective") -> None:
    """Raise :class:`UnboundAxisError` naming ``op`` and the axis unless every name is bound."""
    for name in axis_names(axis_name):
        _bound_size(name, op)


def axis_size(axis_name: AxisName | Sequence[str] | None) -> int:
    """Number of participants along the axis (product over several names); 1 for ``None``."""
    size = 1
    for name in axis_names(axis_name):
        size *= _bound_size(name, "axis_size")
    return size


def _collective(op: Callable[..., Any], op_name: str) -> Callable[..., Any]:
    def collective(x: Any, axis_name: AxisName | None = None, **kwargs: Any) -> Any:
        if axis_name is None:
            return x
        require_bound(axis_name, op_name)
        return op(x, axis_name, **kwargs)

    collective.__name__ = collective.__qualname__ = op_name
    collective.__doc__ = (
        f"``jax.lax.{op_name}`` over every leaf of ``x`` along ``axis_name``; identity when it is None.\n\n"
        "Every participant of the axis must call this with leaves of the same shapes and dtypes."
    )
    return collective


pmean = _collective(jax.lax.pmean, "pmean")
psum = _collective(jax.lax.psum, "psum")
pmin = _collective(jax.lax.pmin, "pmin")
pmax = _collective(jax.lax.pmax, "pmax")


def all_gather(x: Any, axis_name: AxisName | None = None, **kwargs: Any) -> Any:
    """All-gather every leaf of ``x`` along ``axis_name`` (kwargs: ``axis``, ``tiled``, ...).

    With ``axis_name=None`` and ``tiled=False`` a size-1 axis is inserted at ``axis`` so the result
    has the same rank on one device as on many (EvoRL returned ``x`` unchanged, a shape trap).
    With ``tiled=True`` and ``None`` the result is ``x``.
    """
    if axis_name is not None:
        require_bound(axis_name, "all_gather")
        return jax.lax.all_gather(x, axis_name, **kwargs)
    if kwargs.get("tiled", False):
        return x
    axis = kwargs.get("axis", 0)
    return jax.tree.map(lambda leaf: jnp.expand_dims(leaf, axis), x)


def _checked(name: str) -> bool:
    """True when ``name`` is a ``shard_map`` axis with ``check_vma=True`` (types track variance)."""
    return name in varying_axes(jax.lax.axis_index(name))


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes along which ``x`` may differ between devices, as JAX's ``check_vma`` types say.

    Empty outside ``shard_map``, under ``vmap`` and under ``shard_map(check_vma=False)``.
    """
    aval = jax.typeof(x)
    vma: Any = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def as_varying(tree: Any, axis_name: AxisName | Sequence[str] | None) -> Any:
    """Mark every leaf as varying along ``axis_name`` so its gradient stays per-device.

    Why: inside ``shard_map(check_vma=True)`` JAX differentiates a parameter that is invariant
    (replicated) along an axis as the *sum* of every device's gradient. Differentiate with respect
    to ``as_varying(params, axis)`` instead to get each device's own gradient, then average it
    (``pmean``, :func:`popmesh.jax.mean_grads`). Identity for ``None``, under ``vmap`` and
    under ``check_vma=False``, where gradients are per-device already.
    """
    names = axis_names(axis_name)
    require_bound(names, "as_varying")
    checked = tuple(name for name in names if _checked(name))
    if not checked:
        return tree

    def vary(leaf: Any) -> Any:
        missing = tuple(name for name in checked if name not in varying_axes(leaf))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(vary, tree)
