"""Seeding a rank that rejoined the population after it was lost: PBT's exploit, from the survivors.

After ``world.reform()`` the restarted process holds a fresh, untrained agent. Rather than letting
it start over (or waste the population's time as a weak member until the next decision), every rank
calls :func:`seed_newcomers`: the survivors' metrics pick the ``donors`` best, and each newcomer takes
the mean of their weights and floating buffers (the demo's learning rate rides along as a buffer),
the best donor's optimizer state (its hyper-parameters included) and its counters. Survivors keep
their own agents: nobody loses an iteration. With ``explore=`` each newcomer then moves the
hyper-parameters it inherited (PBT's explore step), so that newcomers bring diversity of their own
instead of copies of the best agent's values.

Decisions are pure (:func:`choose_donors`); the movement is an all-reduce per chunk of the weights (at
most 64 MiB, so no rank holds a second copy of its model) in which only the donors contribute, the
best donor's optimizer state streamed to the newcomers alone (:mod:`popmesh.torch.stream`), and one
broadcast of its counters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from popmesh.comm.collectives import all_gather_object, all_reduce, broadcast_object
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError
from popmesh.population.decisions.options import Explore
from popmesh.population.state.model_state import model_tensors
from popmesh.torch.chunking import DEFAULT_CHUNK_BYTES, TensorSpec, plan_chunks
from popmesh.torch.stream import element_views, stream_state_

__all__ = ["Seeding", "choose_donors", "seed_newcomers"]


@dataclass(frozen=True)
class Seeding:
    """How the newcomers were seeded: who, from which donors (global ranks, best first), with what."""

    newcomers: tuple[int, ...]
    donors: tuple[int, ...]
    weights: tuple[float, ...]
    counters: Mapping[str, Any]
    explored: Mapping[str, list[Any]] = field(default_factory=dict)
    """On a newcomer seeded with ``explore=``: each explored key's ``[inherited, new]`` value; else empty."""


def choose_donors(metrics: Sequence[float], ranks: Sequence[int], newcomers: Sequence[int], k: int) -> list[int]:
    """The ``k`` survivors (ranks not in ``newcomers``) with the highest metric, best first (NaN last,
    ties by rank). Pure."""
    if k < 1:
        raise ConfigError(f"donors={k}: a newcomer needs at least one donor")
    survivors = [(r, m) for r, m in zip(ranks, metrics) if r not in newcomers]
    if not survivors:
        raise ConfigError("every rank joined as a new process: no survivor can seed the population; resume from a "
                          "checkpoint instead")
    survivors.sort(key=lambda rm: (math.isnan(rm[1]), -rm[1] if not math.isnan(rm[1]) else 0.0, rm[0]))
    return [r for r, _ in survivors[:k]]


def seed_newcomers(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, metric: float,
                   counters: Mapping[str, Any] | None = None, *, donors: int = 2, include_buffers: bool = True,
                   group: Comm | None = None, timeout: float | None = None,
                   newcomers: Sequence[int] | None = None, explore: Explore | None = None,
                   seed: int = 0) -> Seeding | None:
    """Every rank of ``group`` calls this after the world re-formed; the newcomers (``world.newcomers``, or
    the ranks given: those a resumed checkpoint holds no agent of, ``checkpoint.missing_ranks``) take
    the mean of the best ``donors`` others' weights (and floating buffers), the best donor's optimizer
    state and its ``counters`` (returned on every rank). None when no rank is new.

    ``explore``: each newcomer then perturbs (or resamples) the optimizer hyper-parameters it inherited
    (:meth:`Explore.apply`, seeded by ``seed``, the counters' ``"iteration"`` and its global rank), as a
    replaced agent does after PBT's exploit; it needs ``optimizer``."""
    if explore is not None and optimizer is None:
        raise ConfigError("seed_newcomers(explore=...) moves the optimizer's hyper-parameters: pass the optimizer")
    comm = resolve_group(group)
    newcomers = tuple(r for r in (comm.world.newcomers if newcomers is None else newcomers) if r in comm.ranks)
    if not newcomers:
        return None
    metrics = [float("nan") if m is None else float(m)
               for m in all_gather_object(None if math.isnan(metric) else metric, group=comm, timeout=timeout)]
    chosen = choose_donors(metrics, comm.ranks, newcomers, donors)
    weight = 1.0 / len(chosen)
    _mean_into_newcomers(model_tensors(model, include_buffers), chosen, newcomers, weight, comm, timeout)
    if optimizer is not None:
        stream_state_(None, optimizer, donors=chosen[:1], receivers=newcomers, group=comm, timeout=timeout)
    taken = broadcast_object(dict(counters or {}) if comm.rank == chosen[0] else None, src=chosen[0], group=comm,
                             timeout=timeout)
    explored: dict[str, list[Any]] = {}
    if explore is not None and comm.rank in newcomers:
        explored = explore.apply(optimizer, seed, _explore_key(taken), comm.rank)
    return Seeding(newcomers, tuple(chosen), (weight,) * len(chosen), taken, explored)


def _explore_key(counters: Mapping[str, Any]) -> int:
    """The iteration the explore step is seeded with: the donor's ``"iteration"`` counter (0 without one)."""
    value = counters.get("iteration", 0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _mean_into_newcomers(tensors: Mapping[str, torch.Tensor], donors: Sequence[int], newcomers: Sequence[int],
                         weight: float, comm: Comm, timeout: float | None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """The donors' weighted sum of ``tensors`` written into the newcomers' own, one all-reduce per chunk
    of at most ``chunk_bytes``: every rank holds at most a few chunks beside its model."""
    names = list(tensors)
    specs = [TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()]
    giving, taking = comm.rank in donors, comm.rank in newcomers
    with torch.no_grad():
        for chunk in plan_chunks(specs, chunk_bytes):
            views: dict[str, torch.Tensor] = {}
            for piece in chunk.pieces:
                for j, v in enumerate(element_views(tensors[names[piece.tensor]].detach(), piece.start, piece.stop)):
                    views[f"{piece.tensor}:{piece.start}:{j}"] = v
            share = {key: v * weight if giving else torch.zeros_like(v) for key, v in views.items()}
            mean = all_reduce(share, "sum", group=comm, timeout=timeout)
            if taking:
                for key, v in views.items():
                    v.copy_(mean[key])
