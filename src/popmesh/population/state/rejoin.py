"""Seeding a rank that rejoined the population after it was lost: PBT's exploit, from the survivors.

After ``world.reform()`` the restarted process holds a fresh, untrained agent. Rather than letting
it start over (or waste the population's time as a weak member until the next decision), every rank
calls :func:`seed_newcomers`: the survivors' metrics pick the ``donors`` best, and each newcomer takes
the mean of their weights and floating buffers (the demo's learning rate rides along as a buffer),
the best donor's optimizer state (its hyper-parameters included) and its counters. Survivors keep
their own agents: nobody loses an iteration.

Decisions are pure (:func:`choose_donors`); the movement is one fused all-reduce in which only the
donors contribute, plus one broadcast of the best donor's optimizer state and counters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from popmesh.comm.collectives import all_gather_object, all_reduce, broadcast_object
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError
from popmesh.population.state.model_state import model_tensors
from popmesh.torch.handover import broadcast_optimizer_state

__all__ = ["Seeding", "choose_donors", "seed_newcomers"]


@dataclass(frozen=True)
class Seeding:
    """How the newcomers were seeded: who, from which donors (global ranks, best first), with what."""

    newcomers: tuple[int, ...]
    donors: tuple[int, ...]
    weights: tuple[float, ...]
    counters: Mapping[str, Any]


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
                   newcomers: Sequence[int] | None = None) -> Seeding | None:
    """Every rank of ``group`` calls this after the world re-formed; the newcomers (``world.newcomers``, or
    the ranks given: those a resumed checkpoint holds no agent of, ``checkpoint.missing_ranks``) take
    the mean of the best ``donors`` others' weights (and floating buffers), the best donor's optimizer
    state and its ``counters`` (returned on every rank). None when no rank is new."""
    comm = resolve_group(group)
    newcomers = tuple(r for r in (comm.world.newcomers if newcomers is None else newcomers) if r in comm.ranks)
    if not newcomers:
        return None
    metrics = [float("nan") if m is None else float(m)
               for m in all_gather_object(None if math.isnan(metric) else metric, group=comm, timeout=timeout)]
    chosen = choose_donors(metrics, comm.ranks, newcomers, donors)
    weight = 1.0 / len(chosen)
    tensors = model_tensors(model, include_buffers)
    with torch.no_grad():
        share = {name: t.detach() * weight if comm.rank in chosen else torch.zeros_like(t)
                 for name, t in tensors.items()}
        mean = all_reduce(share, "sum", group=comm, timeout=timeout)
        if comm.rank in newcomers:
            for name, t in tensors.items():
                t.copy_(mean[name])
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, chosen[0], group=comm, timeout=timeout, load=comm.rank in newcomers)
    taken = broadcast_object(dict(counters or {}) if comm.rank == chosen[0] else None, src=chosen[0], group=comm,
                             timeout=timeout)
    return Seeding(newcomers, tuple(chosen), (weight,) * len(chosen), taken)
