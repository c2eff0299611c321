"""torchgfn's mpi4py communicators beside a torch world, when an MPI launcher started the job.

torchgfn's ``initialize_distributed_compute`` builds torch groups and, beside them, mpi4py
communicators over the same ranks (its context's ``dc_mpi4py``), which its MPI spawn policies and
its training script use. A popmesh world runs on one engine; where that engine is torch and mpiexec
started the job, :func:`open_side` makes those communicators (``MPI_COMM_WORLD`` split by role, as
torchgfn does, through :class:`~popmesh.engines.mpi.beside.MpiBeside`) and remembers the popmesh
group each stands for: the facades take them back as that group (:func:`~popmesh.compat._native.comm_of`),
and the one-sided policies open their windows on them (:func:`window_opener`). Collectives and
messages keep running on the world's own engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from popmesh.comm.world import Comm, World, current_world
from popmesh.compat._native import forget, remember
from popmesh.core.errors import ConfigError
from popmesh.engines.base import SnapshotWindow
from popmesh.engines.mpi.beside import MpiBeside, launched_by_mpi, torch_env_over_mpi
from popmesh.topology.roles import Roles

__all__ = ["Side", "torch_env_under_mpi", "open_side", "side_of", "communicators", "fields_beside", "side_comm",
           "release", "window_opener", "without_mpi", "Unavailable", "SideField"]


@dataclass(eq=False)
class Side:
    """A torch world's MPI side: the communicator made for each list of global ranks."""

    world: World
    beside: MpiBeside
    comms: dict[tuple[int, ...], Any] = field(default_factory=dict)


_SIDES: dict[int, Side] = {}  # id(world) -> its side


def side_of(world: World) -> Side | None:
    """``world``'s MPI side, if :func:`open_side` made one and the world is still up."""
    side = _SIDES.get(id(world))
    return side if side is not None and side.world is world and not world.finalized else None


def open_side(world: World) -> Side:
    """The MPI side of ``world`` (a torch world in a job an MPI launcher started), made on first use:
    MPI's ranks are checked to be the world's. Collective over the world."""
    side = side_of(world)
    if side is None:
        side = Side(world, MpiBeside(world.rank, world.size))
        side.comms[tuple(range(world.size))] = side.beside.world
        remember(side.beside.world, world)  # MPI.COMM_WORLD stands for the world itself
        _SIDES[id(world)] = side
    return side


def communicators(side: Side, groups: Sequence[Comm]) -> list[Any]:
    """New mpi4py communicators for ``groups`` (``COMM_NULL`` where this rank is no member), one per
    list of ranks among them (torchgfn's one agent group of all trainers is its training group), in
    order; the side's communicator of those ranks from now on. Collective over the world: every rank
    passes the same groups in the same order."""
    made: dict[tuple[int, ...], Any] = {}
    for group in groups:
        ranks = tuple(group.ranks)
        if ranks not in made:
            made[ranks] = side.comms[ranks] = side.beside.communicator(ranks)
        if made[ranks] != side.beside.null:
            remember(made[ranks], group)
    return [made[tuple(group.ranks)] for group in groups]


def torch_env_under_mpi() -> None:
    """Under an MPI launcher, before a torch world forms: its RANK, WORLD_SIZE and rendezvous from MPI
    (torchgfn exported the first two from PMI_RANK/PMI_SIZE), unless the user set RANK. Collective
    over MPI_COMM_WORLD."""
    try:
        current_world()
        return  # a world exists (or a world of one: nothing was launched)
    except ConfigError:
        pass
    if launched_by_mpi() and not os.environ.get("RANK"):
        os.environ.update(torch_env_over_mpi())


def fields_beside(roles: Roles) -> dict[str, Any]:
    """``roles``' fields with their groups as mpi4py communicators over the same ranks (COMM_NULL
    where this rank is no member): torchgfn's mpi4py context of a torch world. Collective over the
    world (it opens the world's side on first use)."""
    side = open_side(roles.world)
    out = {f.name: getattr(roles, f.name) for f in fields(Roles)}
    n, buffers = len(roles.agent_groups), [] if roles.buffer_group is None else [roles.buffer_group]
    comms = communicators(side, [*roles.agent_groups, roles.train_global_group, *buffers])
    out.update(agent_groups=comms[:n], train_global_group=comms[n], buffer_group=comms[n + 1] if buffers else None)
    return out


def release(side: Side, comms: Sequence[Any]) -> None:
    """Free ``comms`` (made by :func:`communicators`) and forget them."""
    for comm in {id(c): c for c in comms if c is not None}.values():
        for ranks in [r for r, c in side.comms.items() if c is comm]:
            del side.comms[ranks]
        forget(comm)
        side.beside.free(comm)


def side_comm(comm: Comm) -> Any | None:
    """The mpi4py communicator standing for ``comm``, if its world has a side that made one."""
    side = side_of(comm.world)
    return None if side is None else side.comms.get(tuple(comm.ranks))


def window_opener(comm: Comm) -> Callable[[int], SnapshotWindow] | None:
    """How to open an MPI snapshot window over ``comm``'s ranks on its world's side (None without a
    side): on the side's communicator of those ranks, or one made then among the members only."""
    side = side_of(comm.world)
    if side is None:
        return None

    def open_window(nbytes: int) -> SnapshotWindow:
        ranks = tuple(comm.ranks)
        native = side.comms.get(ranks)
        if native is None or native == side.beside.null:
            native = side.comms[ranks] = side.beside.members_communicator(ranks)
        return side.beside.snapshot_window(native, ranks, nbytes)

    return open_window


def without_mpi(world: World, wanted: str) -> str:
    """Why ``world`` has no mpi4py communicators for ``wanted``, and what to do."""
    if launched_by_mpi():
        return (f"{wanted} needs the mpi4py communicators that initialize_distributed_compute builds beside the "
                f"torch groups when mpiexec started the job: call it first (every rank, the same arguments)")
    return (f"{wanted} needs MPI, and this job was not started by an MPI launcher (its world runs on the "
            f"{world.engine_name} engine alone): launch it with `mpiexec -n {max(world.size, 2)} python script.py` "
            f"(`pip install 'popmesh[mpi]'` brings mpiexec) or `popmesh launch -n {max(world.size, 2)} --engine mpi "
            "script.py`")


class Unavailable:
    """What a context holds in place of its mpi4py side where the job has none: why, and what to do."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class SideField:
    """A dataclass field's descriptor (torchgfn's ``DistributedContext.dc_mpi4py``): reads as what was
    stored (None by default), except :class:`Unavailable`, which raises ConfigError with its reason, so
    that a script asking for mpi4py communicators outside an MPI launch learns how to launch instead
    of failing later on None."""

    def __init__(self, name: str) -> None:
        self._key = f"_{name}_stored"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return None  # the dataclass default
        value = self.stored(obj)
        if isinstance(value, Unavailable):
            raise ConfigError(value.reason)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self._key] = None if value is self else value  # the default arrives as the descriptor

    def stored(self, obj: object) -> Any:
        """What ``obj`` holds, without raising."""
        return obj.__dict__.get(self._key)
