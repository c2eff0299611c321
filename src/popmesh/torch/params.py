"""Model sync for torch modules: average gradients, average parameters, copy one rank's weights.

What OmniSafe's ``avg_grads``/``sync_params``/``avg_params`` and torchgfn's ``average_gradients``/
``average_models`` do (their facades in :mod:`popmesh.compat` map onto these), with popmesh's fixes:
every function takes ``group=`` and divides by the size of the group it reduces over; gradients that
are None on some ranks count as zeros instead of hanging; :func:`broadcast_params_` copies buffers
(normaliser statistics, BatchNorm running stats) as well as parameters; everything is written in
place (hence the trailing ``_``), so optimizers keep pointing at the same tensors.

Cross-rank contract: every rank of ``group`` calls the same function with the same model structure
(parameter and buffer names, shapes, dtypes). Ranks outside ``group`` call nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from popmesh.comm.collectives import all_reduce_, broadcast_
from popmesh.comm.world import Comm, resolve_group
from popmesh.torch.bucketing import ParamSpec, plan_buckets
from popmesh.torch.sync import GradientSync, default_cap_bytes

__all__ = ["mean_grads_", "mean_params_", "broadcast_params_"]

_SYNCS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary[Comm, GradientSync]] = (
    weakref.WeakKeyDictionary()
)


def _sync_for(module: Any, comm: Comm, timeout: float | None) -> GradientSync:
    """One GradientSync per (module, group), kept while both live; a fresh one for tensors."""
    if not isinstance(module, torch.nn.Module):
        return GradientSync(module, comm, overlap=False, timeout=timeout)
    per_group = _SYNCS.get(module)
    if per_group is None:
        per_group = _SYNCS[module] = weakref.WeakKeyDictionary()
    sync = per_group.get(comm)
    if sync is None:
        sync = per_group[comm] = GradientSync(module, comm, overlap=False, timeout=timeout, weak=True)
    return sync


def mean_grads_(module: Any, group: Comm | None = None, *, timeout: float | None = None) -> None:
    """Replace every gradient of ``module`` by its average over ``group``, in place.

    Bucketed (one collective per bucket, through a cached :class:`GradientSync`); after the first
    call gradients live in that sync's flat buffers. A gradient that is None on some ranks counts as
    zeros there and is materialised with the average; one that is None on every rank stays None.
    ``module`` may also be a single tensor (OmniSafe's example) or a sequence of tensors.
    """
    comm = resolve_group(group)
    comm.require_member("mean_grads_")
    _sync_for(module, comm, timeout).wait(timeout)


def _chunks(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype and device into chunks of at most ``cap`` bytes (one call each)."""
    live = [t for t in tensors if t.numel()]
    specs = [ParamSpec(str(i), t.numel(), str(t.dtype), str(t.device)) for i, t in enumerate(live)]
    plan = plan_buckets(specs, cap_bytes=cap, order="forward")
    return [[live[i] for i in bucket.indices] for bucket in plan.buckets]


def _state_tensors(module: torch.nn.Module, buffers: bool) -> list[torch.Tensor]:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    tensors = [p.detach() for p in module.parameters()]
    if buffers:
        tensors += [b.detach() for b in module.buffers()]
    return tensors


def broadcast_params_(module: torch.nn.Module, src: int = 0, group: Comm | None = None, *,
                buffers: bool = True, timeout: float | None = None) -> None:
    """Copy global rank ``src``'s parameters and buffers into every rank's ``module``, in place.

    Call it once after building the model so that all ranks start from the same weights and the
    same normaliser statistics (``buffers=False`` copies parameters only). ``src`` must be a member
    of ``group``.
    """
    comm = resolve_group(group)
    comm.require_member("broadcast_params_")
    comm.to_group_rank(src)  # ConfigError if src is not a member, at every group size
    if comm.size == 1:
        return
    with torch.no_grad():
        for chunk in _chunks(_state_tensors(module, buffers), default_cap_bytes(comm)):
            broadcast_(chunk, src=src, group=comm, timeout=timeout)


def mean_params_(module: torch.nn.Module, group: Comm | None = None, *, timeout: float | None = None) -> None:
    """Replace every parameter of ``module`` by its average over ``group``, in place (divides by
    the group's size). Buffers are left alone; use :func:`broadcast_params_` to copy them."""
    comm = resolve_group(group)
    comm.require_member("mean_params_")
    if comm.size == 1:
        return
    with torch.no_grad():
        for chunk in _chunks(_state_tensors(module, False), default_cap_bytes(comm)):
            all_reduce_(chunk, "avg", group=comm, timeout=timeout)
