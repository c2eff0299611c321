"""MPI beside a torch world: for a job that an MPI launcher started but whose world runs on torch.

torchgfn's ``initialize_distributed_compute("gloo", ...)`` runs a torch process group *and* hands its
users mpi4py communicators over the same ranks (``dc_mpi4py``), when mpiexec started the job. This
module is what popmesh needs of MPI there, and nothing more: no second world, no heartbeat, no
point-to-point transport.

* :func:`launched_by_mpi`: whether an MPI process manager started this process.
* :func:`torch_env_over_mpi`: the variables a torch world needs (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``...), agreed over ``MPI_COMM_WORLD``; rank 0 holds the
  rendezvous socket from the start, as under ``popmesh launch``, so no port is picked and then raced for.
* :class:`MpiBeside`: communicators over given global ranks (``MPI_COMM_WORLD`` split by role, as
  torchgfn builds them) and one-sided snapshot windows on them (:mod:`popmesh.engines.mpi.window`).
  MPI's ranks must be the world's ranks; that is checked.
* :func:`abort_running`: ``MPI_Abort`` on ``MPI_COMM_WORLD`` where MPI is up (a failing rank takes an
  MPI job down with it, whoever initialised MPI).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from popmesh.core.errors import ConfigError, EngineUnavailable
from popmesh.engines.base import GroupSpec, SnapshotWindow

__all__ = ["MPI_RANK_VARIABLES", "launched_by_mpi", "torch_env_over_mpi", "MpiBeside", "abort_running"]

MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI process manager (mpiexec, mpirun, srun --mpi=pmix) started this process."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name) for name in MPI_RANK_VARIABLES + _SIZE_VARIABLES)


def _mpi() -> Any:
    """mpi4py's ``MPI`` module (MPI initialised on first use)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise EngineUnavailable("mpi4py communicators need mpi4py and an MPI library: "
                                "pip install 'popmesh[mpi]'") from e
    return MPI


def torch_env_over_mpi(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a torch world over this MPI job's ranks: rank and size from ``MPI_COMM_WORLD``,
    the local rank from its node, and ``MASTER_ADDR``/``MASTER_PORT`` where the user set none (rank 0
    listens on a port of its own and tells the others; ``POPMESH_STORE_FD`` hands the socket to the
    store). Collective over ``MPI_COMM_WORLD``: every rank calls it."""
    environ = os.environ if environ is None else environ
    MPI = _mpi()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    env = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_size)}
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return env
    one_node = local_size == size
    address = environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node else socket.gethostname())
    port = 0
    if rank == 0:
        sock = socket.create_server(("127.0.0.1" if one_node else "", int(environ.get("MASTER_PORT") or 0)),
                                    backlog=max(64, size + 8))
        port = int(sock.getsockname()[1])
        env["POPMESH_STORE_FD"] = str(sock.detach())  # the torch store takes the descriptor over
    address, port = world.bcast((address, port), root=0)
    env.update(MASTER_ADDR=str(address), MASTER_PORT=str(port))
    return env


@dataclass(frozen=True)
class _Handle:
    """What :class:`~popmesh.engines.mpi.window.MpiSnapshotWindow` needs of a group: its ranks and communicator."""

    spec: GroupSpec
    comm: Any


class MpiBeside:
    """MPI beside the torch world of rank ``rank`` of ``size``: the same processes, the same ranks.

    ConfigError when MPI's ``COMM_WORLD`` is not that world (another size, or ranks in another order).
    """

    def __init__(self, rank: int, size: int) -> None:
        self.mpi = MPI = _mpi()
        self.world = MPI.COMM_WORLD
        mpi_rank, mpi_size = self.world.Get_rank(), self.world.Get_size()
        if (mpi_rank, mpi_size) != (rank, size):
            raise ConfigError(f"MPI_COMM_WORLD is rank {mpi_rank} of {mpi_size} here but the torch world is rank "
                              f"{rank} of {size}: the mpi4py communicators must cover the same ranks. Let the MPI "
                              "launcher set RANK and WORLD_SIZE (unset them), or launch without mpiexec")
        self.null = MPI.COMM_NULL

    def communicator(self, ranks: Sequence[int]) -> Any:
        """A communicator over global ``ranks`` (in that order): ``MPI_COMM_WORLD`` split by role, as
        torchgfn builds them; ``COMM_NULL`` where this rank is no member. Collective over the whole
        world: every rank calls it, in the same order, with the same ranks."""
        group = self.world.Get_group().Incl([int(r) for r in ranks])
        try:
            return self.world.Create(group)
        finally:
            group.Free()

    def members_communicator(self, ranks: Sequence[int]) -> Any:
        """As :meth:`communicator`, collective over ``ranks`` only (MPI-3 ``Comm_create_group``): only
        members call it."""
        group = self.world.Get_group().Incl([int(r) for r in ranks])
        try:
            return self.world.Create_group(group)
        finally:
            group.Free()

    def snapshot_window(self, comm: Any, ranks: Sequence[int], nbytes: int) -> SnapshotWindow:
        """An MPI-3 snapshot window of ``nbytes`` per member over ``comm`` (whose group ranks are global
        ``ranks``); collective over ``comm``."""
        from popmesh.engines.mpi.window import MpiSnapshotWindow

        return MpiSnapshotWindow(self.mpi, _Handle(GroupSpec(-1, tuple(int(r) for r in ranks)), comm), nbytes)

    def free(self, comm: Any) -> None:
        """Free ``comm`` (a communicator of :meth:`communicator`); nothing for ``COMM_NULL`` or ``COMM_WORLD``."""
        if comm != self.null and comm != self.world and not self.mpi.Is_finalized():
            comm.Free()


def abort_running(code: int = 1) -> None:
    """``MPI_Abort`` on ``MPI_COMM_WORLD`` if this process initialised MPI and has not finalised it (the
    MPI launcher then ends every rank of the job); nothing otherwise. Never imports MPI."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    MPI.COMM_WORLD.Abort(code)
