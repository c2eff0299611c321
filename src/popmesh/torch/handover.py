"""Handing a rank that rejoined the world the state of the run: weights, optimizer state, counters.

After ``world.reform()`` the survivors and the restarted process (it finds itself in
``world.newcomers`` after ``init()``) call :func:`hand_over` together; every rank then holds the
state of one survivor, so no rank starts over. The optimizer's state travels through popmesh's safe
codec (no pickle): its tensors as a dict of arrays, the rest (parameter groups, plain numbers) as JSON.
"""

from __future__ import annotations

from typing import Any

import torch

from popmesh.comm.collectives import broadcast_object
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError
from popmesh.torch.params import broadcast_params_

__all__ = ["hand_over", "donor_of", "broadcast_optimizer_state"]


def donor_of(group: Comm | None = None) -> int:
    """The lowest rank of ``group`` that is not new in the current generation: the one to copy."""
    comm = resolve_group(group)
    survivors = [r for r in comm.ranks if r not in comm.world.newcomers]
    if not survivors:
        raise ConfigError(f"every rank of {list(comm.ranks)} joined as a new process: no survivor holds the run's "
                          "state to hand over; resume from a checkpoint instead")
    return survivors[0]


def hand_over(module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              state: Any = None, *, src: int | None = None, group: Comm | None = None,
              timeout: float | None = None) -> Any:
    """Give every rank of ``group`` rank ``src``'s ``module`` weights and buffers (in place),
    ``optimizer`` state (loaded) and ``state`` (a JSON value; returned). ``src``: :func:`donor_of`.

    Every rank of ``group`` must call it with the same kinds of arguments (a module or None, an
    optimizer or None); other ranks' ``state`` is ignored.
    """
    comm = resolve_group(group)
    src = donor_of(comm) if src is None else src
    if module is not None:
        broadcast_params_(module, src=src, group=comm, timeout=timeout)
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, src, group=comm, timeout=timeout)
    return broadcast_object(state if comm.rank == src else None, src=src, group=comm, timeout=timeout)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int, *, group: Comm | None = None,
                              timeout: float | None = None, load: bool = True) -> None:
    """Load rank ``src``'s optimizer state into every rank's ``optimizer`` (same parameters, same kind),
    without pickle: the tensors as a dict of arrays, the rest as JSON. Every rank of ``group`` calls it;
    ``load=False`` takes part without loading (a rank that keeps its own state)."""
    comm = resolve_group(group)
    mine = comm.rank == src
    meta, tensors = _split(optimizer.state_dict()) if mine else (None, None)
    meta = broadcast_object(meta, src=src, group=comm, timeout=timeout)
    tensors = broadcast_object(tensors, src=src, group=comm, timeout=timeout)
    if load and not mine:
        optimizer.load_state_dict(_join(meta, tensors))


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An optimizer's state dict as JSON (keys as text) plus its tensors under ``"param/name"`` keys."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for param, entries in state_dict["state"].items():
        plain[str(param)] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}/{name}"] = value.detach().cpu()
            else:
                plain[str(param)][name] = value
    return {"state": plain, "param_groups": _json(state_dict["param_groups"])}, tensors


def _join(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(param): dict(entries) for param, entries in meta["state"].items()}
    for key, value in tensors.items():
        param, name = key.split("/", 1)
        state.setdefault(int(param), {})[name] = torch.as_tensor(value)
    return {"state": state, "param_groups": meta["param_groups"]}


def _json(value: Any) -> Any:
    """Tuples as lists (JSON has none); everything else as it is."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value
