"""Handing a rank that rejoined the world the state of the run: weights, optimizer state, counters.

After ``world.reform()`` the survivors and the restarted process (it finds itself in
``world.newcomers`` after ``init()``) call :func:`hand_over` together; every rank then holds the
state of one survivor, so no rank starts over. With ``applied=`` (each rank's count of applied steps)
that survivor is one that applied the fewest, so a data-parallel step whose reduction failed on some
rank is applied by none, whichever ranks saw it complete. The state is streamed (:mod:`popmesh.torch.stream`):
the small metadata first, then the tensors in chunks of at most 64 MiB, written straight into the
receivers' parameters and buffers, the optimizer's state allocated once and loaded; the donor never
holds a second copy, and no pickle is involved. With several newcomers, ``donors=`` spreads the
chunks over several survivors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from popmesh.comm.collectives import all_gather_object, broadcast_object
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError
from popmesh.torch.chunking import fewest_applied, hand_over_roles, survivors_of
from popmesh.torch.stream import stream_state_

__all__ = ["hand_over", "donor_of", "broadcast_optimizer_state"]


def donor_of(group: Comm | None = None) -> int:
    """The lowest rank of ``group`` that is not new in the current generation: the one to copy."""
    comm = resolve_group(group)
    return _first_survivor(comm, comm.world.newcomers)


def _first_survivor(comm: Comm, newcomers: Sequence[int]) -> int:
    return survivors_of(comm.ranks, newcomers)[0]


def hand_over(module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              state: Any = None, *, src: int | None = None, group: Comm | None = None,
              timeout: float | None = None, donors: int = 1, newcomers: Sequence[int] | None = None,
              chunk_bytes: int | None = None, applied: int | None = None) -> Any:
    """Give every rank of ``group`` rank ``src``'s ``module`` weights and buffers (in place),
    ``optimizer`` state (loaded) and ``state`` (a JSON value; returned). ``src``: :func:`donor_of`.

    Every rank of ``group`` must call it with the same kinds of arguments (a module or None, an
    optimizer or None) of the same structure; a rank whose model differs (a name, dtype or shape) makes
    it a ConfigError on every rank, naming the tensor. Other ranks' ``state`` is ignored.

    ``donors``: with more than one, only the newcomers (``newcomers``, default ``world.newcomers``)
    take the state, and ``src`` and the next lowest survivors, up to ``donors`` ranks that hold the
    same state (data-parallel ranks do), each send a share of the chunks. ``chunk_bytes``: the
    largest message (default 64 MiB; the donor stages at most two).

    ``applied``: how many steps this rank had applied (its optimizer steps; a newcomer's is ignored),
    for all-or-nothing steps after a lost rank. ``src`` is then the lowest survivor that applied the
    fewest, and with ``donors`` > 1 every rank that applied more takes the state too: a step that
    failed on one rank while another saw its reduction complete and applied it is undone there, so
    every rank holds the same parameters and optimizer state, the failed step applied by none. Pass
    it on every rank or on none; ConfigError with ``src=`` too.
    """
    comm = resolve_group(group)
    new = tuple(r for r in (comm.world.newcomers if newcomers is None else newcomers) if r in comm.ranks)
    counts = all_gather_object(applied, group=comm, timeout=timeout)  # so a rank that left it out is named
    holders = None
    if any(count is not None for count in counts):
        if src is not None:
            raise ConfigError("hand_over: give src= or applied=, not both (applied= picks the source: a survivor "
                              "that applied the fewest steps)")
        holders = fewest_applied(comm.ranks, counts, new)
        src = holders[0]
    src = _first_survivor(comm, new) if src is None else src
    givers, takers = hand_over_roles(comm.ranks, src, new, donors, holders)
    stream_state_(module, optimizer, donors=givers, receivers=takers, group=comm, timeout=timeout,
                  chunk_bytes=chunk_bytes)
    return broadcast_object(state if comm.rank == src else None, src=src, group=comm, timeout=timeout)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int, *, group: Comm | None = None,
                              timeout: float | None = None, load: bool = True) -> None:
    """Load rank ``src``'s optimizer state into every rank's ``optimizer`` (same parameters, same kind),
    streamed as :func:`hand_over` does. Every rank of ``group`` calls it; ``load=False`` takes part
    without loading (a rank that keeps its own state: nothing is sent to it)."""
    comm = resolve_group(group)
    loads = all_gather_object(bool(load), group=comm, timeout=timeout)
    receivers = [r for r, wants in zip(comm.ranks, loads) if wants and r != src]
    stream_state_(None, optimizer, donors=[src], receivers=receivers, group=comm, timeout=timeout)
