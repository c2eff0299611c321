"""Nested structures of arrays: flattening, leaf kinds and dtype names, without importing torch.

A *leaf* is a numpy array, a torch tensor, a numpy scalar or a Python scalar (bool, int, float,
complex). Containers are dicts, lists and tuples (named tuples included), nested freely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TreeDef",
    "flatten",
    "unflatten",
    "is_torch",
    "is_leaf",
    "dtype_name",
    "leaf_shape",
    "device_name",
    "to_array",
    "restore_scalar",
]

_SCALARS = (bool, int, float, complex, np.generic)


def is_torch(x: Any) -> bool:
    """True for a torch tensor, decided without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def is_leaf(x: Any) -> bool:
    """Whether ``x`` is something a collective reduces directly."""
    return isinstance(x, (np.ndarray,) + _SCALARS) or is_torch(x)


@dataclass(frozen=True)
class TreeDef:
    """The shape of a nested structure: ``kind`` is leaf/dict/list/tuple/namedtuple."""

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple[Any, ...] = ()
    cls: Any = None

    def describe(self) -> str:
        """A compact text form, equal on two ranks iff the structures are equal."""
        if self.kind == "leaf":
            return "*"
        inner = ",".join(c.describe() for c in self.children)
        if self.kind == "dict":
            return "{" + ",".join(f"{k!r}:{c.describe()}" for k, c in zip(self.keys, self.children)) + "}"
        return ("[" + inner + "]") if self.kind == "list" else ("(" + inner + ")")


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Leaves in a deterministic order (dict keys in insertion order) and the structure."""
    leaves: list[Any] = []
    return leaves, _flatten(tree, leaves)


def _flatten(node: Any, leaves: list[Any]) -> TreeDef:
    if isinstance(node, dict):
        keys = tuple(node.keys())
        return TreeDef("dict", tuple(_flatten(node[k], leaves) for k in keys), keys, type(node))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return TreeDef("namedtuple", tuple(_flatten(v, leaves) for v in node), (), type(node))
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return TreeDef(kind, tuple(_flatten(v, leaves) for v in node))
    if not is_leaf(node):
        raise TypeError(
            f"cannot communicate a {type(node).__name__}: use numpy arrays, torch tensors, Python "
            "scalars, or dicts/lists/tuples of them (the *_object variants take other objects)"
        )
    leaves.append(node)
    return TreeDef("leaf")


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    iterator = iter(leaves)
    return _build(treedef, iterator, lambda: next(iterator))


def _build(treedef: TreeDef, it: Any, take: Callable[[], Any]) -> Any:
    if treedef.kind == "leaf":
        return take()
    values = [_build(c, it, take) for c in treedef.children]
    if treedef.kind == "dict":
        out = dict(zip(treedef.keys, values))
        return out if treedef.cls in (dict, None) else treedef.cls(out)
    if treedef.kind == "namedtuple":
        return treedef.cls(*values)
    return values if treedef.kind == "list" else tuple(values)


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(x: Any) -> str:
    """``float32``, ``bfloat16``… for numpy arrays, torch tensors and scalars alike (cached per dtype:
    numpy computes ``dtype.name`` in Python, which showed up in small-message latency)."""
    dtype = x.dtype if isinstance(x, np.ndarray) or is_torch(x) else np.asarray(x).dtype
    key = (type(dtype), dtype)  # numpy and torch dtypes never compare with each other
    name = _DTYPE_NAMES.get(key)
    if name is None:
        name = str(dtype).removeprefix("torch.") if is_torch(x) else dtype.name
        _DTYPE_NAMES[key] = name
    return name


def leaf_shape(x: Any) -> tuple[int, ...]:
    """Shape of an array leaf; ``()`` for scalars."""
    return tuple(int(s) for s in getattr(x, "shape", ()))


def device_name(x: Any) -> str:
    """``cpu`` for numpy and scalars, the tensor's device otherwise (``cuda:0``)."""
    return str(x.device) if is_torch(x) else "cpu"


def to_array(x: Any) -> Any:
    """Scalars become 0-d numpy arrays; arrays and tensors are returned as they are."""
    if isinstance(x, _SCALARS):
        return np.asarray(x)
    return x


def restore_scalar(template: Any, value: Any) -> Any:
    """Give ``value`` (a 0-d array) back the scalar type of ``template`` if that was a scalar."""
    if isinstance(template, np.generic):
        return np.asarray(value).astype(template.dtype)[()]
    if isinstance(template, bool):
        return bool(np.asarray(value))
    if isinstance(template, (int, float, complex)):
        return type(template)(np.asarray(value).item())
    return value
