"""The seeds hand out their engine's own group objects (a torch ProcessGroup, an MPI communicator),
which their users pass to torch or mpi4py directly; the facades hand out the same, and map them
back to popmesh's groups when they come back in."""

from __future__ import annotations

from typing import Any

from popmesh.comm.world import Comm, current_world

__all__ = ["native_of", "comm_of", "remember", "forget"]

_BY_ID: dict[int, tuple[Any, Comm]] = {}  # id(native) -> (native, its popmesh group); keeps both alive


def native_of(comm: Comm) -> Any:
    """``comm``'s engine group (``comm`` itself on the local engine), remembered for :func:`comm_of`."""
    native = comm.native
    if native is None:
        return comm
    _BY_ID[id(native)] = (native, comm)
    return native


def remember(native: Any, comm: Comm) -> None:
    """Take ``native`` (an engine object beside the world's own, such as an mpi4py communicator over
    a torch group's ranks) back as ``comm`` from now on."""
    _BY_ID[id(native)] = (native, comm)


def forget(native: Any) -> None:
    """Stop taking ``native`` back (it was freed)."""
    _BY_ID.pop(id(native), None)


def comm_of(group: Any) -> Comm | None:
    """The popmesh group of ``group`` (a popmesh group, or an engine group :func:`native_of` handed
    out, or the current world's own); None for anything else."""
    if isinstance(group, Comm):
        return group
    hit = _BY_ID.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    world = current_world()
    return world if group is world.native else None
