"""Handing a model's and optimizer's state to other ranks in bounded chunks, at the transport's speed.

:func:`stream_state_` moves the parameters, buffers and optimizer state of one or more donors to the
receivers. The small metadata goes first, as one object from the first donor: every tensor's name,
dtype and shape, the optimizer's parameter groups and its plain (non-tensor) state. Every rank checks
its own model against it, and a mismatch is a ConfigError on every rank that names the tensor, before
any large message moves. Then the tensors travel in chunks of at most ``chunk_bytes``
(:mod:`popmesh.torch.chunking` plans them): one broadcast per chunk when one donor gives every other
rank, else point-to-point messages, several donors sharing the chunks:

* a donor sends a chunk that is one contiguous range of one CPU tensor straight from that tensor's
  memory (and a broadcast writes it straight into the receivers' tensor likewise), and copies the
  others (small tensors packed together, non-contiguous ranges, tensors on an accelerator) into one of
  at most two staging buffers of one chunk each: it never holds a second copy of its state;
* a receiver writes each chunk into its own parameters and buffers, in place, and into its optimizer's
  state tensors where it has them with the donor's dtype and shape; the others it allocates once, from
  the metadata, before loading the state.

Cross-rank contract: every rank of ``group`` calls :func:`stream_state_` with the same ``donors``,
``receivers`` and ``chunk_bytes``; donors hold the same state (the first one's metadata is the one
used), and every donor and receiver passes a module and an optimizer of the same structure (or None
on every rank). Ranks that are neither only take part in the metadata round.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from popmesh.comm.collectives import all_gather_object, broadcast_, broadcast_object
from popmesh.comm.messages import HANDOVER_TAGS, INTERNAL_TAG_BASE, RecvHandle, SendHandle, internal_tag, irecv, isend
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, MessageError
from popmesh.torch.chunking import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    StreamPlan,
    TensorSpec,
    compare_specs,
    plan_chunks,
    plan_stream,
    plan_transfers,
)

__all__ = ["STREAM_TAG", "Tensors", "stream_state_", "describe_state", "element_views"]

STREAM_TAG = internal_tag(HANDOVER_TAGS.start - INTERNAL_TAG_BASE)
"""The popmesh-internal tag the chunks travel on (the first offset after popmesh.observe's range)."""
_LARGE = 4 << 20  # from here numpy asks for huge pages
_IN_FLIGHT = 2  # chunks a donor keeps on the wire (and staging buffers it may hold); receives posted per donor

Tensors = torch.nn.Module | Mapping[str, torch.Tensor] | None
"""What :func:`stream_state_` moves besides the optimizer: a module (its parameters under their names,
its buffers as ``buffer:<name>``), a mapping of names to tensors (written in place), or None."""


def stream_state_(module: Tensors, optimizer: torch.optim.Optimizer | None = None, *, donors: Sequence[int],
                  receivers: Sequence[int], group: Comm | None = None, timeout: float | None = None,
                  chunk_bytes: int | None = None) -> StreamPlan:
    """Give every rank of ``receivers`` the donors' ``module`` tensors (in place) and ``optimizer`` state
    (loaded), in chunks of at most ``chunk_bytes`` (default 64 MiB) spread over ``donors`` (global ranks;
    the first one's metadata is used). Returns the plan (what moved, and who sent it).

    Every rank of ``group`` calls it (see the module's contract). ConfigError on every rank when a
    donor's or receiver's model or optimizer differs from the first donor's, naming the tensor.
    """
    comm = resolve_group(group)
    comm.require_member("stream_state_")
    donors, receivers = _members(comm, donors, "donors"), _members(comm, receivers, "receivers")
    chunk = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    plan_chunks((), chunk)  # a bad chunk_bytes or rank list is the same ConfigError on every rank, before any message
    plan_transfers((), donors, receivers)
    if not receivers:
        return StreamPlan((), (), ())
    me, source = comm.rank, donors[0]
    meta = broadcast_object(describe_state(module, optimizer) if me == source else None, src=source, group=comm,
                            timeout=timeout)
    taking_part = me in donors[1:] or me in receivers
    problem = _difference(meta, module, optimizer, me in donors) if taking_part else None
    _agree(problem, comm, source, timeout)
    plan = plan_stream(_specs(meta), donors, receivers, chunk)
    everyone = len(donors) == 1 and len(receivers) == comm.size - 1  # one donor to all: broadcasts, no copies
    with torch.no_grad():
        if me in donors or me in receivers:
            giving = me in donors
            tensors, loaded = (_held(module, optimizer, meta), None) if giving else _targets(meta, module, optimizer)
            if everyone:
                _broadcast(plan, source, tensors, comm, timeout)
            elif giving:
                _send(plan, me, tensors, comm, timeout)
            else:
                _receive(plan, me, tensors, comm, timeout)
            if loaded is not None and optimizer is not None:
                optimizer.load_state_dict(loaded)
    return plan


def describe_state(module: Tensors, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The metadata a donor sends first (JSON): the module's tensors as ``[name, dtype, shape]``, and the
    optimizer's parameters, state tensors (with the device type they live on), plain state and groups."""
    meta: dict[str, Any] = {"module": None if module is None else _spec_rows(_module_tensors(module)),
                            "optimizer": None}
    if optimizer is not None:
        state_dict = optimizer.state_dict()
        tensors, plain = _split_optimizer(state_dict)
        meta["optimizer"] = {
            "params": [[_dtype(p), list(p.shape)] for p in _params(optimizer)],
            "tensors": [row + [t.device.type] for row, t in zip(_spec_rows(tensors), tensors.values())],
            "plain": plain,
            "param_groups": _json(state_dict["param_groups"]),
        }
    return meta


def element_views(t: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Views of ``t`` that together hold its elements ``[start, stop)`` in C order, without copying:
    one 1-D slice when ``t`` is contiguous; otherwise blocks of whole rows and partial rows at the ends,
    so that a range of a non-contiguous tensor costs only its own size to read or write."""
    if stop <= start:
        return []
    if t.is_contiguous() or t.dim() <= 1:
        return [t.reshape(-1)[start:stop]]
    row = t.numel() // t.shape[0]
    first, last = start // row, (stop - 1) // row
    if first == last:
        return element_views(t[first], start - first * row, stop - first * row)
    views: list[torch.Tensor] = []
    lo = first
    if start > first * row:
        views += element_views(t[first], start - first * row, row)
        lo = first + 1
    hi = last + 1 if stop == (last + 1) * row else last
    if hi > lo:
        views.append(t[lo:hi])
    if hi == last:
        views += element_views(t[last], 0, stop - last * row)
    return views


# ---- what a rank holds ------------------------------------------------------------------------
def _module_tensors(module: Tensors) -> dict[str, torch.Tensor]:
    if module is None:
        return {}
    if isinstance(module, torch.nn.Module):
        named = {name: p.detach() for name, p in module.named_parameters()}
        named.update({f"buffer:{name}": b.detach() for name, b in module.named_buffers()})
        return named
    if isinstance(module, Mapping) and all(isinstance(t, torch.Tensor) for t in module.values()):
        return {str(name): t.detach() for name, t in module.items()}
    raise ConfigError(f"expected a torch.nn.Module, a mapping of names to tensors or None, got {type(module).__name__}")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _split_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """An optimizer's state as tensors under ``optimizer:<param>/<key>`` and the rest as JSON."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for param, entries in state_dict["state"].items():
        plain[str(param)] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer:{param}/{key}"] = value.detach()
            else:
                plain[str(param)][key] = value
    return tensors, plain


def _held(module: Tensors, optimizer: torch.optim.Optimizer | None, meta: dict[str, Any]) -> list[torch.Tensor]:
    """A donor's tensors in the metadata's order (names checked equal by :func:`_difference`)."""
    named = _module_tensors(module)
    if optimizer is not None:
        named.update(_split_optimizer(optimizer.state_dict())[0])
    return [named[s.name] for s in _specs(meta)]


def _targets(meta: dict[str, Any], module: Tensors,
             optimizer: torch.optim.Optimizer | None) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
    """A receiver's tensors to write into, in the metadata's order: its own module's tensors, then the
    optimizer state allocated from the metadata; and the state dict to load once they are written."""
    own = _module_tensors(module)
    targets = [own[name] for name, _, _ in meta["module"] or ()]
    opt = meta["optimizer"]
    if opt is None or optimizer is None:
        return targets, None
    params = _params(optimizer)
    state: dict[int, dict[str, Any]] = {int(p): dict(entries) for p, entries in opt["plain"].items()}
    for name, dtype, shape, device in opt["tensors"]:
        param, key = name.removeprefix("optimizer:").split("/", 1)
        where = "cpu" if device == "cpu" else params[int(param)].device
        t = _reusable(optimizer.state.get(params[int(param)], {}).get(key), dtype, shape, where)
        if t is None:
            t = _fresh(shape, getattr(torch, dtype), where)
        state.setdefault(int(param), {})[key] = t
        targets.append(t)
    return targets, {"state": state, "param_groups": opt["param_groups"]}


def _fresh(shape: list[int], dtype: torch.dtype, where: Any) -> torch.Tensor:
    """A new tensor to receive into. Large host tensors are allocated by numpy, which asks the kernel for
    2 MiB pages there (torch does only under ``THP_MEM_ALLOC_ENABLE=1``): a newcomer's fresh optimizer
    state is faulted in 512 times fewer pages while it arrives (about twice as fast measured)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(where).type != "cpu" or nbytes < _LARGE:
        return torch.empty(shape, dtype=dtype, device=where)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _reusable(held: Any, dtype: str, shape: list[int], where: Any) -> torch.Tensor | None:
    """The receiver's own optimizer tensor when it has the donor's dtype, shape and device: written in
    place, so a rank that has state takes the donor's without allocating (or faulting in) a second one."""
    if (isinstance(held, torch.Tensor) and _dtype(held) == dtype and list(held.shape) == shape
            and held.device == torch.device(where)):
        return held.detach()
    return None


# ---- the metadata round -----------------------------------------------------------------------
def _specs(meta: dict[str, Any]) -> list[TensorSpec]:
    rows = list(meta["module"] or ()) + [row[:3] for row in (meta["optimizer"] or {}).get("tensors", ())]
    return [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows]


def _difference(meta: dict[str, Any], module: Tensors, optimizer: torch.optim.Optimizer | None,
                donor: bool) -> str | None:
    """How this rank's model (and, on a donor, optimizer state) differs from the first donor's, or None."""
    for what, sent, held in (("a module", meta["module"], module), ("an optimizer", meta["optimizer"], optimizer)):
        if (sent is None) != (held is None):
            return (f"the donor hands over {what} and this rank passed None" if held is None
                    else f"this rank passed {what} and the donor None")
    if module is not None:
        problem = compare_specs(_rows_to_specs(meta["module"]), _rows_to_specs(_spec_rows(_module_tensors(module))))
        if problem:
            return problem
    opt = meta["optimizer"]
    if opt is None or optimizer is None:
        return None
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    donors_sizes = [len(g["params"]) for g in opt["param_groups"]]
    if sizes != donors_sizes:
        return f"the optimizer's parameter groups hold {sizes} parameters here and {donors_sizes} on the donor"
    named = [[f"optimizer parameter {i}", d, s] for i, (d, s) in enumerate(opt["params"])]
    params = [[f"optimizer parameter {i}", _dtype(p), list(p.shape)] for i, p in enumerate(_params(optimizer))]
    problem = compare_specs(_rows_to_specs(named), _rows_to_specs(params))
    if problem or not donor:
        return problem
    own = _spec_rows(_split_optimizer(optimizer.state_dict())[0])
    return compare_specs(_rows_to_specs([row[:3] for row in opt["tensors"]]), _rows_to_specs(own))


def _agree(problem: str | None, comm: Comm, source: int, timeout: float | None) -> None:
    """Every rank learns every rank's problem, and all raise the same ConfigError (no rank is left waiting)."""
    problems = all_gather_object(problem, group=comm, timeout=timeout)
    found = [f"rank {r}: {p}" for r, p in zip(comm.ranks, problems) if p]
    if found:
        raise ConfigError(f"handing over rank {source}'s state: " + "; ".join(found) + ". Build the same model "
                          "(parameter and buffer names, dtypes, shapes) and optimizer on every rank first")


# ---- moving the chunks ------------------------------------------------------------------------
def _buffer(free: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """A staging buffer of at least ``nbytes``: one given back to ``free`` if large enough, else a new one."""
    buf = free.pop() if free else None
    return buf if buf is not None and buf.numel() >= nbytes else torch.zeros(nbytes, dtype=torch.uint8)


def _broadcast(plan: StreamPlan, source: int, tensors: list[torch.Tensor], comm: Comm, timeout: float | None) -> None:
    """One donor to every other rank: one broadcast per chunk, from and into the tensors' own memory
    where a chunk is one contiguous CPU range of one tensor (on either side), else through one buffer."""
    giving = comm.rank == source
    free: list[torch.Tensor] = []
    for chunk in plan.chunks:
        direct = _direct(chunk, tensors)
        if direct is not None:
            broadcast_(direct, src=source, group=comm, timeout=timeout)
            continue
        buf = _buffer(free, chunk.nbytes)
        payload = _gather(chunk, tensors, buf) if giving else buf[: chunk.nbytes]
        broadcast_(payload, src=source, group=comm, timeout=timeout)
        if not giving:
            _scatter(chunk, payload, tensors, source)
        free.append(buf)


def _send(plan: StreamPlan, me: int, tensors: list[torch.Tensor], comm: Comm, timeout: float | None) -> None:
    """Send this donor's chunks, at most ``_IN_FLIGHT`` on the wire; a chunk that is not one contiguous
    range of one CPU tensor is staged, with at most one other staged chunk still on the wire."""
    free: list[torch.Tensor] = []
    queue: deque[tuple[list[SendHandle], torch.Tensor | None]] = deque()

    def finish_oldest() -> None:
        handles, staged = queue.popleft()
        for h in handles:
            h.wait()
        if staged is not None:
            free.append(staged)

    for c, receivers in plan.sends_of(me):
        chunk = plan.chunks[c]
        payload, staged = _direct(chunk, tensors), None
        if payload is None:
            while len(queue) >= _IN_FLIGHT:
                finish_oldest()
            staged = _buffer(free, chunk.nbytes)
            payload = _gather(chunk, tensors, staged)
        queue.append(([isend(payload, r, STREAM_TAG, group=comm, timeout=timeout) for r in receivers], staged))
        while len(queue) > _IN_FLIGHT:
            finish_oldest()
    while queue:
        finish_oldest()


def _direct(chunk: Chunk, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The chunk's bytes as a view of a tensor's own memory, when it is one contiguous CPU range."""
    if len(chunk.pieces) != 1:
        return None
    piece = chunk.pieces[0]
    t = tensors[piece.tensor]
    if t.device.type != "cpu":
        return None
    views = element_views(t, piece.start, piece.stop)
    if len(views) != 1 or not views[0].is_contiguous():
        return None
    return views[0].reshape(-1).view(torch.uint8)


def _gather(chunk: Chunk, tensors: list[torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
    """The chunk's pieces copied into ``staging`` (its first ``chunk.nbytes`` bytes, returned)."""
    for piece in chunk.pieces:
        t = tensors[piece.tensor]
        typed = staging[piece.offset: piece.offset + (piece.stop - piece.start) * t.element_size()].view(t.dtype)
        done = 0
        for v in element_views(t, piece.start, piece.stop):
            typed[done: done + v.numel()].view(v.shape).copy_(v)
            done += v.numel()
    return staging[: chunk.nbytes]


def _receive(plan: StreamPlan, me: int, targets: list[torch.Tensor], comm: Comm, timeout: float | None) -> None:
    """Take this receiver's chunks in order, with ``_IN_FLIGHT`` receives posted per donor."""
    expected = plan.receives_of(me)
    left = Counter(donor for _, donor in expected)
    posted: dict[int, deque[RecvHandle]] = {d: deque() for d in left}

    def post(donor: int) -> None:
        while left[donor] and len(posted[donor]) < _IN_FLIGHT:
            posted[donor].append(irecv(donor, STREAM_TAG, group=comm, timeout=timeout))
            left[donor] -= 1

    for donor in left:
        post(donor)
    for c, donor in expected:
        _, payload = posted[donor].popleft().wait()
        post(donor)
        _scatter(plan.chunks[c], payload, targets, donor)


def _scatter(chunk: Chunk, payload: Any, targets: list[torch.Tensor], donor: int) -> None:
    """The chunk's bytes written into the receiver's tensors."""
    data = payload if isinstance(payload, torch.Tensor) else torch.as_tensor(payload)
    if data.dtype != torch.uint8 or data.numel() != chunk.nbytes:
        raise MessageError(f"chunk {chunk.index} of the hand-over from rank {donor} holds {data.numel()} "
                           f"{data.dtype} elements where the plan says {chunk.nbytes} bytes: another message "
                           "arrived on popmesh's hand-over tag; run one hand-over at a time")
    for piece in chunk.pieces:
        t = targets[piece.tensor]
        typed = data[piece.offset: piece.offset + (piece.stop - piece.start) * t.element_size()].view(t.dtype)
        done = 0
        for v in element_views(t, piece.start, piece.stop):
            v.copy_(typed[done: done + v.numel()].view(v.shape))
            done += v.numel()


# ---- small helpers ----------------------------------------------------------------------------
def _members(comm: Comm, ranks: Sequence[int], what: str) -> tuple[int, ...]:
    members = tuple(int(r) for r in ranks)
    for r in members:
        if r not in comm.ranks:
            raise ConfigError(f"{what}: rank {r} is not a member of {list(comm.ranks)}: pass members' global ranks")
    return members


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _spec_rows(tensors: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    return [[name, _dtype(t), list(t.shape)] for name, t in tensors.items()]


def _rows_to_specs(rows: Sequence[Sequence[Any]]) -> list[TensorSpec]:
    return [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows]


def _json(value: Any) -> Any:
    """Tuples as lists (JSON has none); everything else as it is."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value
