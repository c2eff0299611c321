"""``gfn.utils.distributed`` (torchgfn) over popmesh's world, collectives, messages and contexts.

Same names, parameters, order and defaults as the original. torchgfn ran a torch process group and
an mpi4py communicator side by side and picked one per call with ``backend="torch"|"mpi"``; in
popmesh one world runs on one engine. The facade maps ``"torch"`` to the torch engine and ``"mpi"``
to the MPI engine: a collective whose ``backend`` names another engine than the running world's
raises ``ConfigError`` (pass the other name, or launch under the other launcher) instead of quietly
using another engine. A world of one (nothing launched) accepts either name. ``group`` is a popmesh
``Group``/``World`` or one of the context's groups, which are the engine's own as in the seed (a
torch ProcessGroup, an MPI communicator: ``dist.barrier(group=ctx.train_global_group)`` works);
None means the whole world.

Map: ``average_gradients`` → ``popmesh.torch.mean_grads_``; ``average_models`` → ``mean_params_``;
``gather_distributed_data`` → ``popmesh.observe.stats.gather_rows``; ``report_time_info`` /
``report_load_imbalance`` → ``popmesh.report_timings`` / ``report_imbalance``;
``DistributedContext`` → ``popmesh.Roles`` (built by ``popmesh.assign_roles``).

Where popmesh deliberately behaves differently from torchgfn:

* ``send``/``isend`` reinterpret the tensor's bytes as uint8 (torchgfn's torch path *value*-cast
  floats to uint8, and its MPI path failed for bfloat16); ``recv`` returns exactly those bytes.
  Both backends use popmesh's one wire format, so the ``backend`` name of a point-to-point call
  only has to be valid: a sender using ``"torch"`` and a receiver using ``"mpi"`` interoperate, on
  whatever engine the world runs. Every blocking call has the world's timeout (CommTimeout).
* ``broadcast``'s ``src`` is a global rank on both backends (torchgfn's MPI path read it as a rank
  within the communicator).
* ``all_reduce`` also accepts ``"AVG"`` (divides by the group's size) and ``"PROD"``.
* ``average_models`` divides by the size of ``training_group`` (torchgfn divided by the global world
  size, shrinking the weights whenever buffer or coordinator ranks existed), in place;
  ``average_gradients`` is bucketed and treats a missing gradient as zeros.
* ``gather_distributed_data`` carries sizes as int64 (torchgfn used the data's dtype, corrupting
  counts above 255 for uint8), takes any trailing shape, gathers on the group's first rank (torchgfn
  required global rank 0 to belong to the group), and ``world_size``/``rank`` default to the
  group's size and group rank (torchgfn used global values even for a sub-group).
* ``get_rank`` returns the rank within ``group`` (-1 for non-members, as torch did) on both backends.
* ``report_time_info``/``report_load_imbalance`` tolerate ranks with fewer iterations (torchgfn
  raised IndexError) and log to ``logger``.
* ``initialize_distributed_compute*`` build one :class:`~popmesh.Roles` (:func:`popmesh.assign_roles`).
  As in torchgfn after v2.4.1, ``num_agent_groups`` defaults to 1 and the layout comes from the ranks' host
  names when there are buffer managers (each manager on the node of the agents it serves), else by arithmetic;
  ``initialize_distributed_compute_mpi4py(..., layout=)`` takes a given :class:`RankLayout` instead (this
  facade's or popmesh's own; ConfigError where it does not fit the world). The contexts carry
  ``coordinator_rank``, ``buffer_rank_set`` and ``training_ranks``; on the coordinator ``is_training_rank()``
  and ``is_buffer_rank()`` are false and ``is_coordinator_rank()`` true. Both check the formed world against
  the rank and size an MPI launcher announced (``PMI_*``, ``OMPI_COMM_WORLD_*``, ``MV2_COMM_WORLD_*``): a
  ConfigError names the variables where mpi4py runs another MPI than the launcher's (every process would
  otherwise be a world of one). ``num_coordinators`` is 0 or 1.
  ``dc_mpi4py`` is a view of the same groups on an MPI world; on a torch world that an MPI launcher
  started, mpi4py communicators over the torch groups' ranks (:mod:`popmesh.compat._mpi_side`),
  which the facades and the MPI spawn policies take back (``backend="mpi"`` too); elsewhere reading
  it raises a ConfigError that says how to launch, not a None that fails later. Under an MPI
  launcher ``"gloo"`` takes ``RANK``, ``WORLD_SIZE`` and the rendezvous from MPI (torchgfn took the
  first two, and needed ``MASTER_ADDR``/``MASTER_PORT``). ``dist_backend="ccl"`` is not supported;
  ``cleanup()`` does not finalize MPI behind other users' backs (torchgfn called ``MPI.Finalize``).
* ``RankLayout`` (torchgfn's, after v2.4.1) is a view of :class:`popmesh.topology.RankLayout` (``.native``),
  which assigns the ranks as torchgfn does; bad input raises ConfigError naming the argument (torchgfn's
  ``assert``, ``ValueError``, or a ZeroDivisionError for ``from_hostnames`` without managers), and every
  layout is checked to give each rank one role. Its warnings are popmesh's ``LayoutWarning`` (torchgfn
  logged them), and "agent groups span nodes" is not raised for a single agent group. ``summary()`` is
  popmesh's text. Without managers ``from_hostnames`` keeps each node's ranks together, as ``build`` does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch

import popmesh.comm.collectives as _collectives
import popmesh.comm.messages as _messages
import popmesh.core.launch_env as _launch_env
import popmesh.engines as _engines
import popmesh.observe.stats as _stats
import popmesh.topology.layout as _layout
import popmesh.topology.roles as _roles
import popmesh.torch as _pt
from popmesh.comm.world import Comm, World
from popmesh.comm.world import current_world as _current_world
from popmesh.comm.world import init as _init
from popmesh.compat._gfn_ranks import RankLayout, check_announced, native_layout
from popmesh.compat._mpi_side import (
    SideField,
    Unavailable,
    fields_beside,
    release,
    side_of,
    torch_env_under_mpi,
    without_mpi,
)
from popmesh.compat._native import comm_of, native_of
from popmesh.core.errors import ConfigError
from popmesh.engines.mpi.beside import launched_by_mpi
from popmesh.observe.reports import format_report
from popmesh.observe.timing import report_imbalance as _report_imbalance
from popmesh.observe.timing import report_timings as _report_timings

__all__ = [
    "Group",
    "RankLayout",
    "default_backend",
    "logger",
    "AsyncSendHandle",
    "DistributedContext",
    "DistributedContextMPI4Py",
    "all_gather",
    "all_reduce",
    "average_gradients",
    "average_models",
    "barrier",
    "broadcast",
    "gather_distributed_data",
    "get_rank",
    "get_world_size",
    "initialize_distributed_compute",
    "initialize_distributed_compute_mpi4py",
    "isend",
    "recv",
    "report_load_imbalance",
    "report_time_info",
    "send",
]

__newer__ = {  # what torchgfn added after v2.4.1 (its master): a name, and parameters added or given a default
    "RankLayout": (),
    "initialize_distributed_compute": ("num_agent_groups",),
    "initialize_distributed_compute_mpi4py": ("num_agent_groups", "layout"),
}

Group = Comm
"""A popmesh ``World`` or ``Group``: the one communicator type on every engine."""

default_backend = "mpi"
logger = logging.getLogger(__name__)

_ENGINES = {"torch": "torch", "mpi": "mpi"}
_DIST_BACKENDS = {"gloo": "torch", "mpi": "mpi"}


def _world(engine: str | None = None, **options: Any) -> World:
    """The current world (a world of one when nothing was launched); init a launched one if needed,
    with ``options`` (``backend="gloo"``)."""
    try:
        world = _current_world()
    except ConfigError:
        world = _init(**options) if engine is None else _init(engine, **options)
    return world


def _world_options(dist_backend: str) -> dict[str, Any]:
    """How the facade forms a world for torchgfn's ``dist_backend``: ``"gloo"`` is a pure gloo default
    group, on a host with CUDA too, since torchgfn's replay buffer and buffer manager insist on
    ``dist.get_backend() == "gloo"`` (popmesh's own default there is ``"cpu:gloo,cuda:nccl"``)."""
    return {"backend": "gloo"} if dist_backend == "gloo" else {}


def _check_buffer_backend(world: World, num_remote_buffers: int) -> None:
    """ConfigError where torchgfn's buffers would refuse the running world's backend (a world formed
    before the facade, with nccl for CUDA tensors), instead of their bare assertion later."""
    backend = getattr(world.engine, "backend", "gloo")
    if num_remote_buffers > 0 and world.engine_name == "torch" and backend != "gloo":
        raise ConfigError(f"this world's default group runs {backend!r}, and torchgfn's remote replay buffers "
                          "insist on exactly 'gloo': let initialize_distributed_compute form the world, or "
                          "form it with popmesh.init(backend='gloo')")


def _first_env(*names: str, default: str | None = None) -> str | None:
    """The first non-empty environment variable among ``names`` (upstream's private helper)."""
    return _launch_env.first_env(os.environ, *names, default=default)


def _get_MPI() -> Any:
    """mpi4py's MPI module, imported on first use (upstream's private helper)."""
    return _engines.mpi_module()


def _engine(backend: str) -> str:
    if backend not in _ENGINES:
        raise ConfigError(f"Unknown backend {backend!r}: use 'torch' or 'mpi'")  # upstream's words, which tests match
    return _ENGINES[backend]


def _group_of(group: Any, what: str) -> Comm:
    """The popmesh group of ``group`` (None: the world), whatever form the caller holds it in."""
    world = _world()
    comm = world if group is None else comm_of(group)
    if comm is None:
        raise ConfigError(f"{what}: group must be one of the context's groups (e.g. ctx.train_global_group) or a "
                          f"popmesh Group, not {type(group).__name__}")
    return comm


def _comm(backend: str, group: Any, what: str, *, strict: bool = True) -> Comm:
    """The communicator ``backend``/``group`` name, checked against the running world's engine."""
    engine = _engine(backend)
    comm = _group_of(group, what)
    running = comm.world.engine_name
    beside = engine == "mpi" and side_of(comm.world) is not None  # a torch world with its mpi4py side
    if strict and running != engine and comm.world.size > 1 and not beside:
        other = "torch" if running == "torch" else "mpi"
        raise ConfigError(f"{what}(backend={backend!r}) on a world running the {running} engine: pass "
                          f"backend={other!r}, or launch under {'mpiexec' if engine == 'mpi' else 'torchrun'}")
    return comm


@dataclass
class AsyncSendHandle:
    """Handle for a non-blocking send operation. The underlying buffer must remain alive until the
    send completes. Call :meth:`is_complete` to poll or :meth:`wait` to block."""

    _request: Any
    _buffer: Any

    def is_complete(self) -> bool:
        """Check if the send has completed without blocking."""
        return self._request.done()

    def wait(self) -> None:
        """Block until the send completes (CommTimeout after the world's timeout)."""
        self._request.wait()


def _as_bytes(data: Any) -> torch.Tensor:
    """``data``'s bytes as a flat uint8 CPU tensor: reinterpreted, never value-cast."""
    tensor = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def send(data: Any, dst_rank: int, backend: str = default_backend, tag: int = 0) -> None:
    """Send a byte tensor to global rank ``dst_rank``: the raw bytes of ``data``, any dtype.

    ``recv`` on the other end returns an identical uint8 tensor, whatever backend name either side
    passes. Use distinct tags to multiplex independent channels on the same rank pair.
    """
    _comm(backend, None, "send", strict=False)
    _messages.send(_as_bytes(data), dst_rank, tag)


def isend(data: Any, dst_rank: int, backend: str = default_backend, tag: int = 0) -> AsyncSendHandle:
    """Non-blocking send of a byte tensor to ``dst_rank``; keep the handle until it is complete."""
    _comm(backend, None, "isend", strict=False)
    buffer = _as_bytes(data)
    return AsyncSendHandle(_messages.isend(buffer, dst_rank, tag), buffer)


def recv(src_rank: int | None = None, backend: str = default_backend, tag: int = 0) -> tuple[int, torch.Tensor]:
    """Receive a byte tensor from ``src_rank`` (or any rank if None): ``(source rank, uint8 tensor)``."""
    _comm(backend, None, "recv", strict=False)
    source, payload = _messages.recv(src_rank, tag)
    return source, torch.as_tensor(payload)


def barrier(backend: str = default_backend, group: Any = None) -> None:
    """Backend-agnostic barrier synchronization over ``group`` (default: the world)."""
    _collectives.barrier(group=_comm(backend, group, "barrier"))


def get_rank(backend: str = default_backend, group: Any = None) -> int:
    """This process's rank within ``group`` (default: the world); -1 if it is not a member."""
    comm = _comm(backend, group, "get_rank")
    return comm.group_rank if comm.is_member else -1


def get_world_size(backend: str = default_backend, group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    return _comm(backend, group, "get_world_size").size


def all_reduce(tensor: torch.Tensor, op: str = "SUM", backend: str = default_backend,
               group: Any = None) -> None:
    """In-place all-reduce of ``tensor`` over ``group``: ``"SUM"``, ``"MAX"``, ``"MIN"`` (also
    ``"AVG"``, ``"PROD"``). Every member calls it with a tensor of the same shape and dtype."""
    _collectives.all_reduce_(tensor, op, group=_comm(backend, group, "all_reduce"))


def all_gather(output_list: list[torch.Tensor], tensor: torch.Tensor, backend: str = default_backend,
               group: Any = None) -> None:
    """All-gather ``tensor`` into ``output_list`` (one pre-allocated tensor per group rank, whose
    devices are kept). Every member passes a tensor of the same shape."""
    comm = _comm(backend, group, "all_gather")
    if len(output_list) != comm.size:
        raise ConfigError(f"all_gather: output_list has {len(output_list)} tensors for a group of {comm.size}")
    gathered = _collectives.all_gather(tensor, group=comm)
    for out, row in zip(output_list, gathered):
        out.copy_(row)


def broadcast(tensor: torch.Tensor, src: int, backend: str = default_backend, group: Any = None) -> None:
    """Broadcast ``tensor`` in place from **global** rank ``src`` (a member of ``group``)."""
    _collectives.broadcast_(tensor, src, group=_comm(backend, group, "broadcast"))


def gather_distributed_data(local_tensor: Any, world_size: int | None = None, rank: int | None = None,
                            training_group: Any = None) -> torch.Tensor | None:
    """Gather data from all processes: the rows (dim 0) of every rank concatenated on the group's
    first rank, None on the others. ``local_tensor`` is a tensor or a list of rows; row counts may
    differ. ``world_size``/``rank``, when given, must be the group's size and this group rank."""
    comm = _group_of(training_group, "gather_distributed_data")
    if world_size is not None and world_size != comm.size:
        raise ConfigError(f"gather_distributed_data: world_size={world_size} but the group has {comm.size} ranks")
    if rank is not None and comm.is_member and rank != comm.group_rank:
        raise ConfigError(f"gather_distributed_data: rank={rank} but this is rank {comm.group_rank} of the group")
    return _stats.gather_rows(local_tensor, group=comm)


def average_gradients(model: torch.nn.Module) -> None:
    """All-reduce gradients across all models: each becomes the world's average, in place.

    Fixed: bucketed instead of one collective per tensor; a gradient that is None on some ranks
    counts as zeros there instead of crashing or hanging.
    """
    _world()
    _pt.mean_grads_(model)


def average_models(model: torch.nn.Module, training_group: Any = None) -> None:
    """Averages model weights across the ranks of ``training_group`` (default: the world), in
    place, dividing by the group's size (torchgfn divided by the global world size)."""
    _pt.mean_params_(model, _group_of(training_group, "average_models"))


def report_time_info(all_timing_dict: list[dict[str, Any]], world_size: int) -> None:
    """Log per-rank average and total time per step, then the maximum and mean of the totals.
    ``all_timing_dict``: ``[rank0_dict, rank1_dict, ...]``, each ``{"step": [iter0_time, ...]}``."""
    report = _report_timings(all_timing_dict, world_size, show=False)
    if report is not None:
        logger.info("%s", format_report(report))


def report_load_imbalance(all_timing_dict: list[dict[str, Any]], world_size: int) -> None:
    """Log useful (mean over ranks) and waiting (max - mean) time per step, summed over iterations."""
    report = _report_imbalance(all_timing_dict, world_size, show=False)
    if report is not None:
        logger.info("%s", format_report(report))


@dataclass(eq=False)
class DistributedContextMPI4Py(_roles.Roles):
    """Holds all distributed training/replay buffer groups and ranks (on an MPI world)."""


_DC_MPI4PY = SideField("dc_mpi4py")


@dataclass(eq=False)
class DistributedContext(_roles.Roles):
    """Holds all distributed training/replay buffer groups and ranks."""

    dc_mpi4py: DistributedContextMPI4Py | None = field(default=cast(Any, _DC_MPI4PY), repr=False)

    def get_train_group(self, backend: str = "mpi") -> Any:
        """The training group: ``"torch"`` the torch ProcessGroup, ``"mpi"`` the mpi4py communicator (the
        MPI engine's, or the one beside the torch group under an MPI launcher)."""
        side = _DC_MPI4PY.stored(self)
        if _engine(backend) == "mpi" and self.world.engine_name == "torch" and isinstance(side, _roles.Roles):
            return side.train_global_group
        _comm(backend, self.train_global_group, "get_train_group")
        return self.train_global_group

    def cleanup(self) -> None:
        """Cleans up the distributed groups and frees the mpi4py communicators made beside torch ones
        (the world and MPI stay up: finalize with ``popmesh.finalize()``)."""
        side, mpi = side_of(self.world), _DC_MPI4PY.stored(self)
        if side is not None and isinstance(mpi, DistributedContextMPI4Py) and not self._closed:
            release(side, [*mpi.agent_groups, mpi.train_global_group, mpi.buffer_group])
            mpi.cleanup()
        super().cleanup()


def _fields_of(roles: _roles.Roles) -> dict[str, Any]:
    """The context's fields, its groups as the engine's own (torch ProcessGroups, MPI communicators),
    as the seed hands them out: its users pass them to torch.distributed or mpi4py directly."""
    out = {f.name: getattr(roles, f.name) for f in fields(_roles.Roles)}
    out["agent_groups"] = [native_of(g) for g in roles.agent_groups]
    out["train_global_group"] = native_of(roles.train_global_group)
    out["buffer_group"] = None if roles.buffer_group is None else native_of(roles.buffer_group)
    return out


def initialize_distributed_compute(dist_backend: str, num_remote_buffers: int, num_agent_groups: int = 1,
                                   use_coordinator: bool = False) -> DistributedContext:
    """Initializes distributed compute: ``"gloo"`` → the torch engine, ``"mpi"`` → the MPI engine.

    Collective over the world; every rank passes the same arguments. With ``use_coordinator`` the
    last rank becomes the coordinator. Managers are placed from the ranks' host names (node-local where
    ``num_remote_buffers`` is a multiple of the nodes). A world of one gives a single-process context.
    """
    if dist_backend not in _DIST_BACKENDS:
        raise ConfigError(f"dist_backend={dist_backend!r}: use 'gloo' (torch engine) or 'mpi' (MPI engine)")
    if dist_backend == "gloo":
        torch_env_under_mpi()
    world = _world(_DIST_BACKENDS[dist_backend], **_world_options(dist_backend))
    _comm(_DIST_BACKENDS[dist_backend], world, "initialize_distributed_compute")
    check_announced(world.rank, world.size)
    _check_buffer_backend(world, num_remote_buffers)
    ctx = _roles.assign_roles(world, num_buffers=num_remote_buffers, num_agent_groups=num_agent_groups,
                                use_coordinator=use_coordinator)
    if world.engine_name == "mpi":
        mpi: Any = DistributedContextMPI4Py(**_fields_of(ctx))
    elif launched_by_mpi():
        mpi = DistributedContextMPI4Py(**fields_beside(ctx))
    else:
        mpi = None if world.size == 1 else Unavailable(
            without_mpi(world, "dc_mpi4py (the mpi4py communicators)") + "; without MPI, use the torch groups "
            "(ctx.train_global_group) and the torch spawn policies (AverageAllPolicy, AsyncSelectiveAveragingPolicy)")
    return DistributedContext(**_fields_of(ctx), dc_mpi4py=mpi)


def initialize_distributed_compute_mpi4py(num_remote_buffers: int, num_agent_groups: int = 1, num_coordinators: int = 0,
                                          layout: RankLayout | _layout.RankLayout | None = None
                                          ) -> DistributedContextMPI4Py:
    """Initializes distributed compute on the MPI engine (no torch process group needed); on a torch
    world that an MPI launcher started, the mpi4py communicators beside its torch groups.

    ``num_coordinators`` is 0 or 1 (the last rank). ``layout``: a precomputed :class:`RankLayout` (no
    host-name exchange), whose managers must number ``num_remote_buffers``. Collective over the world.
    """
    if num_coordinators not in (0, 1):
        raise ConfigError(f"num_coordinators={num_coordinators}: use 0 or 1")
    world = _world("mpi")
    beside = world.engine_name == "torch" and launched_by_mpi()
    if world.engine_name == "torch" and world.size > 1 and not beside:
        raise ConfigError(without_mpi(world, "initialize_distributed_compute_mpi4py"))
    check_announced(world.rank, world.size)
    native = None if layout is None else native_layout(layout, world.size, bool(num_coordinators))
    if native is not None and native.num_buffers != num_remote_buffers:
        raise ConfigError(f"the layout has {native.num_buffers} buffer manager(s) but num_remote_buffers="
                          f"{num_remote_buffers}: pass the number the layout was built with")
    ctx = _roles.assign_roles(world, native, num_buffers=num_remote_buffers, num_agent_groups=num_agent_groups,
                              use_coordinator=bool(num_coordinators))
    return DistributedContextMPI4Py(**(fields_beside(ctx) if beside else _fields_of(ctx)))
