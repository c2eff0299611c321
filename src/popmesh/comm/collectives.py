"""Collectives with one meaning on every engine, over nested structures of arrays and tensors.

Every function takes ``group=`` (a World or Group; default: the current world) and ``timeout=``
(seconds; default: the world's). Every rank of the group must call the same collective with the same
structure, shapes and dtypes. The reductions and broadcast verify that with a small guard all-reduce
(:mod:`popmesh.comm.guard`, beside the payload once a call repeats) and the gathers compare shapes, so
a mismatch raises :class:`CollectiveMismatch` on every rank instead of a wrong answer; check mode
(``POPMESH_CHECK=1`` / ``init(check=True)``) verifies every call first, listing each rank's values. Returning
versions leave the input untouched; ``_`` versions write into it. dtype and device are kept. In a
group of one every collective returns its input.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from popmesh.comm.agreement import agree, describe_leaves, exchange_all_shapes, exchange_shapes
from popmesh.comm.fusion import apply_fused, fresh_copy, fuse_groups, is_contiguous, write_back
from popmesh.comm.guard import Body, checked, settle
from popmesh.comm.reduction import engine_view, finish_, lowering_of
from popmesh.comm.world import Comm, resolve_group
from popmesh.core import trace
from popmesh.core.arrays import flatten, is_torch, restore_scalar, to_array, unflatten
from popmesh.core.errors import ConfigError
from popmesh.core.ops import Lowering, ReduceOp
from popmesh.core.timeouts import resolve_timeout
from popmesh.wire.objects import decode_object, encode_object

__all__ = [
    "ReduceOp",
    "all_reduce",
    "all_reduce_",
    "all_gather",
    "all_gather_ragged",
    "broadcast",
    "broadcast_",
    "gather",
    "reduce_scatter",
    "barrier",
    "all_gather_object",
    "broadcast_object",
    "gather_object",
]


def _setup(group: Comm | None, timeout: float | None, what: str) -> tuple[Comm, float]:
    comm = resolve_group(group)
    comm.require_member(what)
    return comm, resolve_timeout(timeout, comm.timeout, "timeout", what)


def _leaves(x: Any, what: str, *, mutable: bool = False) -> tuple[list[Any], list[Any], Any]:
    leaves, tree = flatten(x)
    if mutable and any(not (isinstance(v, np.ndarray) or is_torch(v)) for v in leaves):
        raise TypeError(f"{what} writes into its input: pass arrays or tensors, not scalars "
                        "(or use the returning form)")
    return leaves, [to_array(v) for v in leaves], tree


def _check(comm: Comm, what: str, tree: Any, arrays: list[Any], timeout: float, extra: str = "") -> None:
    if comm.check:
        agree(comm, _describe(what, extra, tree, arrays), what, timeout)


def _describe(what: str, extra: str, tree: Any, arrays: list[Any]) -> str:
    """The call as text; leaves fused into more than one engine call (numpy beside torch, several
    dtypes) say how, since that decides the engine calls (two ranks must make the same ones)."""
    groups = fuse_groups(arrays) if len(arrays) > 1 else []
    plan = " fused " + "|".join(",".join(map(str, g)) for g in groups) if len(groups) > 1 else ""
    return f"{what}({extra}) {tree.describe()} {describe_leaves(arrays)}{plan}"


def _run_checked(comm: Comm, what: str, extra: Any, tree: Any, arrays: list[Any], body: Body, timeout: float,
                 writes_input: bool = False) -> Any:
    """``body(arrays, timeout)`` once every rank is known to make the same call: check mode's full
    agreement, or else the always-on guard. ``body`` must not hold on to the caller's data (a rank
    may run it again on zeros to complete a mismatched payload)."""
    text = str(getattr(extra, "value", extra))
    if comm.check:
        agree(comm, _describe(what, text, tree, arrays), what, timeout)
        return body(arrays, timeout)
    key = (what, extra, tree, tuple((a.dtype, tuple(a.shape), device_of(a)) for a in arrays))
    return checked(comm, key, lambda: _describe(what, text, tree, arrays), arrays, body, timeout, what,
                   writes_input=writes_input)


def _rebuild(tree: Any, leaves: list[Any], results: list[Any]) -> Any:
    return unflatten(tree, [restore_scalar(v, r) for v, r in zip(leaves, results)])


# ---- reductions -------------------------------------------------------------------------------
def all_reduce(x: Any, op: Any = "sum", *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """Element-wise reduction across the group (SUM, AVG, MAX, MIN, PROD); a new value, same structure.

    Leaves of one dtype and device are fused into one engine call. AVG divides by the group's size
    (integers: floor division). Booleans: SUM/MAX = any, MIN/PROD = all.
    """
    return _all_reduce(x, op, group, timeout, in_place=False)


def all_reduce_(x: Any, op: Any = "sum", *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """In-place :func:`all_reduce`; returns ``x``."""
    return _all_reduce(x, op, group, timeout, in_place=True)


def _all_reduce(x: Any, op: Any, group: Comm | None, timeout: float | None, *, in_place: bool) -> Any:
    reduce_op = op if type(op) is ReduceOp else ReduceOp.parse(op)
    comm, seconds = _setup(group, timeout, "all_reduce")
    if isinstance(x, np.ndarray) or is_torch(x):
        return _all_reduce_array(x, reduce_op, comm, seconds, in_place)
    leaves, arrays, tree = _leaves(x, "all_reduce_", mutable=in_place)
    for a in arrays:
        lowering_of(a, reduce_op)
    if comm.size == 1:
        return x

    def body(bufs: list[Any], t: float) -> list[Any]:
        return apply_fused(bufs, lambda buf: _reduce_(buf, reduce_op, comm, t), in_place=in_place)

    results = _run_checked(comm, "all_reduce", reduce_op, tree, arrays, body, seconds, in_place)
    return x if in_place else _rebuild(tree, leaves, results)


def _all_reduce_array(x: Any, op: ReduceOp, comm: Comm, seconds: float, in_place: bool) -> Any:
    """The common case, one array or tensor, without the tree machinery (latency matters here)."""
    history = comm.history
    carried = history.carried  # the group's predicted call where its payload carries its check
    if carried is not None and not comm.check:  # is it this call? This function's key, compared field by
        known, lowering = carried.key, carried.lowering  # field (cheaper than building one: small calls'
        if (lowering is not None and x.shape == known[3] and x.dtype is known[2] and op is known[1]  # latency
                and known[0] is _ONE and device_of(x) == known[4]):  # lives here). The prediction's lowering
            # is this call's: no lookup.
            result = _reduce_array(x, op, lowering, comm, seconds, in_place)
            if (carried.finite_item and type(result) is np.ndarray and _isfinite(result.item(0))
                    and history.last == carried.signature):
                history.issued += 1  # settle()'s answer for an unflagged repeat, written inline
                return result
            return settle(comm, carried, result, seconds, "all_reduce", in_place)
    lowering = lowering_of(x, op)
    if comm.size == 1:
        return x
    if comm.check:
        agree(comm, describe_one(op, x), "all_reduce", seconds)
        return _reduce_array(x, op, lowering, comm, seconds, in_place)
    key = (_ONE, op, x.dtype, x.shape, device_of(x))

    def body(bufs: list[Any], t: float) -> Any:
        return _reduce_array(bufs[0], op, lowering, comm, t, in_place)

    return checked(comm, key, lambda: describe_one(op, x), [x], body, seconds, "all_reduce",
                   carry=lowering, writes_input=in_place)


_isfinite = math.isfinite
_ONE = "all_reduce of one array"  # the key of a one-array all_reduce: (_ONE, op, dtype, shape, device)


def device_of(x: Any) -> Any:
    """Where ``x`` lives, as this rank's guard keys its calls: a torch tensor's device (``cuda:0`` and
    ``cpu`` give different keys, so a CUDA call is never taken for a host one); numpy's ``"cpu"``."""
    return getattr(x, "device", None)


def describe_one(op: ReduceOp, x: Any, what: str = "all_reduce") -> str:
    """An all_reduce of one array or tensor as text (``what``: ``all_reduce_async`` for the
    asynchronous form, whose payload never carries its check, so its signature differs)."""
    return f"{what}({op.value}) * {describe_leaves([x])}"


def _reduce_array(x: Any, op: ReduceOp, lowering: Lowering, comm: Comm, timeout: float, in_place: bool) -> Any:
    buf = x if in_place and is_contiguous(x) else fresh_copy(x)
    _reduce_(buf, op, comm, timeout, lowering)
    if in_place and buf is not x:
        write_back(x, buf)
    return x if in_place else buf


def _reduce_(buf: Any, op: ReduceOp, comm: Comm, timeout: float, lowering: Lowering | None = None) -> None:
    """Reduce ``buf`` in place; ``lowering`` when the caller already has it (the one-array fast path)."""
    lowering = lowering_of(buf, op) if lowering is None else lowering
    comm.world.engine.all_reduce_(engine_view(buf, lowering), lowering.engine_op, comm.handle, timeout)
    finish_(buf, lowering, comm.size)


def reduce_scatter(x: Any, op: Any = "sum", *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """Reduce across the group, then give group rank i the i-th equal slice along dim 0.

    Every leaf's leading dimension must be divisible by the group size.
    """
    reduce_op = ReduceOp.parse(op)
    comm, seconds = _setup(group, timeout, "reduce_scatter")
    leaves, arrays, tree = _leaves(x, "reduce_scatter")
    for a in arrays:
        lowering_of(a, reduce_op)
        if a.ndim == 0 or a.shape[0] % comm.size:
            raise ConfigError(
                f"reduce_scatter: leading dimension {tuple(a.shape)[:1]} is not divisible by the group size {comm.size}"
            )
    if comm.size == 1:
        return x

    def body(bufs: list[Any], t: float) -> list[Any]:
        return [_reduce_scatter_leaf(a, reduce_op, comm, t) for a in bufs]

    return _rebuild(tree, leaves, _run_checked(comm, "reduce_scatter", reduce_op, tree, arrays, body, seconds))


def _reduce_scatter_leaf(a: Any, op: ReduceOp, comm: Comm, timeout: float) -> Any:
    buf = a if is_contiguous(a) else fresh_copy(a)
    lowering = lowering_of(buf, op)
    out = comm.world.engine.reduce_scatter(engine_view(buf, lowering), lowering.engine_op, comm.handle, timeout)
    return finish_(out.view(buf.dtype) if lowering.as_bytes else out, lowering, comm.size)


# ---- data movement ----------------------------------------------------------------------------
def all_gather(x: Any, *, concat: bool = False, group: Comm | None = None, timeout: float | None = None) -> Any:
    """Every rank's value, stacked along a new leading axis (``concat=True``: joined along dim 0).

    All ranks must pass the same shapes; a mismatch raises CollectiveMismatch on every rank (the call
    is checked like a reduction's first, so nothing is ever silently truncated). For different leading
    sizes use :func:`all_gather_ragged`.
    """
    comm, seconds = _setup(group, timeout, "all_gather")
    leaves, arrays, tree = _leaves(x, "all_gather")
    _check_concat(arrays, concat)
    if comm.size == 1:
        return _rebuild_gathered(tree, leaves, [_gather_leaf(a, comm, seconds, concat, None) for a in arrays])

    def body(bufs: list[Any], t: float) -> list[Any]:
        return [_gather_leaf(a, comm, t, concat, root=None) for a in bufs]

    return _rebuild_gathered(tree, leaves, _run_checked(comm, "all_gather", "", tree, arrays, body, seconds))


def gather(x: Any, dst: int = 0, *, concat: bool = False, group: Comm | None = None,
           timeout: float | None = None) -> Any:
    """Like :func:`all_gather`, but only global rank ``dst`` receives the result; others get None."""
    comm, seconds = _setup(group, timeout, "gather")
    root = comm.to_group_rank(dst)
    leaves, arrays, tree = _leaves(x, "gather")
    _check_concat(arrays, concat)
    if comm.size == 1:
        return _rebuild_gathered(tree, leaves, [_gather_leaf(a, comm, seconds, concat, root) for a in arrays])

    def body(bufs: list[Any], t: float) -> list[Any]:
        return [_gather_leaf(a, comm, t, concat, root=root) for a in bufs]

    results = _run_checked(comm, "gather", f"dst={dst}", tree, arrays, body, seconds)
    return _rebuild_gathered(tree, leaves, results) if comm.rank == dst else None


def _check_concat(arrays: list[Any], concat: bool) -> None:
    if concat and any(a.ndim == 0 for a in arrays):
        raise ConfigError("concat=True needs arrays with a leading dimension; use the stacked form for scalars")


def _gather_leaf(a: Any, comm: Comm, timeout: float, concat: bool, root: int | None) -> Any:
    buf = a if is_contiguous(a) else fresh_copy(a)
    engine = comm.world.engine
    if comm.size == 1:
        out = buf.unsqueeze(0).clone() if is_torch(buf) else buf[None].copy()
    elif root is None:
        out = engine.all_gather(buf, comm.handle, timeout)
    else:
        out = engine.gather(buf, root, comm.handle, timeout)
    if out is None or not concat:
        return out
    return out.reshape((out.shape[0] * out.shape[1],) + tuple(out.shape[2:]))


def _rebuild_gathered(tree: Any, leaves: list[Any], results: list[Any]) -> Any:
    fixed = [r.tolist() if isinstance(v, (bool, int, float, complex)) else r for v, r in zip(leaves, results)]
    return unflatten(tree, fixed)


def all_gather_ragged(x: Any, *, group: Comm | None = None, timeout: float | None = None) -> list[Any]:
    """Every rank's value where leading sizes may differ (0 included): a list with one entry per
    group rank, each with that rank's structure. dtypes and trailing dimensions must match."""
    comm, seconds = _setup(group, timeout, "all_gather_ragged")
    _, arrays, tree = _leaves(x, "all_gather_ragged")
    for a in arrays:
        if a.ndim == 0:
            raise ConfigError("all_gather_ragged needs arrays with a leading dimension; use all_gather for scalars")
    if comm.size == 1:
        return [x]
    trailing = [_trailing(a) for a in arrays]

    def body(bufs: list[Any], t: float) -> list[Any]:
        shapes = exchange_all_shapes(comm, arrays, "all_gather_ragged", t, same_leading=False)
        per_leaf = [_ragged_leaf(a, comm, t, s) for a, s in zip(arrays, shapes)]
        return [unflatten(tree, [pieces[i] for pieces in per_leaf]) for i in range(comm.size)]

    if comm.check:
        _check(comm, "all_gather_ragged", tree, trailing, seconds)
        return body(arrays, seconds)
    text = _describe("all_gather_ragged", "", tree, trailing)
    return checked(comm, ("all_gather_ragged", text), lambda: text, [], body, seconds, "all_gather_ragged",
                   beside=False)


def _trailing(a: Any) -> Any:
    return a[:0]


def _ragged_leaf(a: Any, comm: Comm, timeout: float, shapes: list[tuple[int, ...]] | None = None) -> list[Any]:
    if shapes is None:
        shapes = exchange_shapes(comm, a, "all_gather_ragged", timeout, same_leading=False)
    longest = max(s[0] for s in shapes)
    padded = _zeros_like_rows(a, longest)
    padded[: a.shape[0]] = a
    stacked = comm.world.engine.all_gather(padded, comm.handle, timeout)
    return [stacked[i, : shapes[i][0]] for i in range(comm.size)]


def _zeros_like_rows(a: Any, rows: int) -> Any:
    shape = (rows,) + tuple(a.shape[1:])
    if is_torch(a):
        import torch

        return torch.zeros(shape, dtype=a.dtype, device=a.device)
    return np.zeros(shape, dtype=a.dtype)


def broadcast(x: Any, src: int = 0, *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """Global rank ``src``'s value on every rank (a new value). Every rank passes the same shapes."""
    return _broadcast(x, src, group, timeout, in_place=False)


def broadcast_(x: Any, src: int = 0, *, group: Comm | None = None, timeout: float | None = None) -> Any:
    """In-place :func:`broadcast`: non-source ranks' arrays are overwritten; returns ``x``."""
    return _broadcast(x, src, group, timeout, in_place=True)


def _broadcast(x: Any, src: int, group: Comm | None, timeout: float | None, *, in_place: bool) -> Any:
    comm, seconds = _setup(group, timeout, "broadcast")
    root = comm.to_group_rank(src)
    leaves, arrays, tree = _leaves(x, "broadcast_", mutable=in_place)
    if comm.size == 1:
        return x
    engine = comm.world.engine

    def body(bufs: list[Any], t: float) -> list[Any]:
        return apply_fused(bufs, lambda buf: engine.broadcast_(buf, root, comm.handle, t), in_place=in_place)

    results = _run_checked(comm, "broadcast", f"src={src}", tree, arrays, body, seconds, in_place)
    return x if in_place else _rebuild(tree, leaves, results)


def barrier(*, group: Comm | None = None, timeout: float | None = None) -> None:
    """Wait until every rank of the group arrives (CommTimeout names the ranks that did not)."""
    comm, seconds = _setup(group, timeout, "barrier")
    if comm.size == 1:
        return
    if comm.check:
        agree(comm, "barrier()", "barrier", seconds)
        comm.world.engine.barrier(comm.handle, seconds)
        return
    # The guard's own round is an all-reduce, which no rank leaves before every rank joined: the
    # barrier itself, and a rank calling another collective meanwhile is a CollectiveMismatch.
    recorder = trace.ACTIVE
    start = time.perf_counter_ns() if recorder is not None else 0
    checked(comm, _BARRIER, _describe_barrier, [], _nothing, seconds, "barrier", beside=False)
    if recorder is not None:  # the timeline shows a barrier, around the guard's all-reduce
        recorder.add("barrier", "comm", start, time.perf_counter_ns(), None)


_BARRIER = ("barrier",)


def _describe_barrier() -> str:
    return "barrier()"


def _nothing(bufs: list[Any], timeout: float) -> None:
    return None


# ---- objects ----------------------------------------------------------------------------------
def all_gather_object(obj: Any, *, group: Comm | None = None, timeout: float | None = None,
                      allow_pickle: bool = False) -> list[Any]:
    """Every rank's object, through popmesh's safe codec (JSON and arrays; pickle only if allowed)."""
    comm, seconds = _setup(group, timeout, "all_gather_object")
    raw = encode_object(obj, allow_pickle=allow_pickle)  # also in a world of one: same errors everywhere
    if comm.size == 1:
        return [decode_object(raw, allow_pickle=allow_pickle)]
    pieces = _objects_checked(comm, ("all_gather_object",), lambda t: _ragged_leaf(raw, comm, t), seconds)
    return [decode_object(p, allow_pickle=allow_pickle) for p in pieces]


def _objects_checked(comm: Comm, key: tuple[Any, ...], run: Any, seconds: float) -> Any:
    """An object collective (sizes first, then bytes) once every rank is known to make it too."""
    text = f"{key[0]}({', '.join(map(str, key[1:]))})"
    if comm.check:
        agree(comm, text, key[0], seconds)
        return run(seconds)
    return checked(comm, key, lambda: text, [], lambda _, t: run(t), seconds, key[0], beside=False)


def gather_object(obj: Any, dst: int = 0, *, group: Comm | None = None, timeout: float | None = None,
                  allow_pickle: bool = False) -> list[Any] | None:
    """Every rank's object on global rank ``dst``; None elsewhere."""
    everything = all_gather_object(obj, group=group, timeout=timeout, allow_pickle=allow_pickle)
    return everything if resolve_group(group).rank == dst else None


def broadcast_object(obj: Any, src: int = 0, *, group: Comm | None = None, timeout: float | None = None,
                     allow_pickle: bool = False) -> Any:
    """Global rank ``src``'s object on every rank (other ranks may pass None)."""
    comm, seconds = _setup(group, timeout, "broadcast_object")
    root = comm.to_group_rank(src)
    raw = encode_object(obj, allow_pickle=allow_pickle) if comm.rank == src else None
    if comm.size == 1:
        return obj
    engine = comm.world.engine

    def run(t: float) -> Any:
        length = np.array([0 if raw is None else raw.size], dtype=np.int64)
        engine.broadcast_(length, root, comm.handle, t)
        payload = raw if raw is not None else np.empty(int(length[0]), dtype=np.uint8)
        engine.broadcast_(payload, root, comm.handle, t)
        return payload

    payload = _objects_checked(comm, ("broadcast_object", src), run, seconds)
    return obj if comm.rank == src else decode_object(payload, allow_pickle=allow_pickle)
