"""Who is who for :mod:`popmesh.compat.gfn`: torchgfn's ``RankLayout`` and the ranks an MPI launcher announced.

:class:`RankLayout` has torchgfn's constructor, attributes, methods and classmethods (its ``gfn.utils.distributed``
after v2.4.1) and holds a :class:`popmesh.topology.RankLayout` (``.native``), which does the assignment:
popmesh's ``build`` and ``from_hostnames`` cut the world into torchgfn's chunks (one per manager, the manager
last; per node when the managers divide among the nodes). The facade only lays that layout out under
torchgfn's names and orders: ``training_ranks`` in chunk order, ``agent_ranks_per_group`` one list per
manager (per node without managers), ``agent_group_rank_list`` consecutive slices of ``training_ranks``.

:func:`announced_by_mpi` reads the rank and size an MPI process manager gave this process, under the names
torchgfn reads (``PMI_*``, Open MPI's ``OMPI_COMM_WORLD_*``, MVAPICH's ``MV2_COMM_WORLD_*``, PMIx's), and
:func:`check_announced` holds a formed world to them.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from popmesh.core.errors import ConfigError
from popmesh.core.launch_env import launcher_world_size
from popmesh.engines.mpi.beside import MPI_RANK_VARIABLES
from popmesh.topology.layout import RankLayout as Layout

__all__ = ["RankLayout", "native_layout", "announced_by_mpi", "check_announced"]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _rank_list(value: object, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(_is_int(r) for r in value):
        raise ConfigError(f"{what} must be a list of integer ranks, got {value!r}")
    return [int(r) for r in value]


def _coordinator(num_coordinators: object) -> bool:
    """torchgfn's ``num_coordinators`` as popmesh's ``use_coordinator`` (its coordinator is the last rank)."""
    if not _is_int(num_coordinators) or num_coordinators not in (0, 1):
        raise ConfigError(f"num_coordinators={num_coordinators!r}: use 0 or 1 (the coordinator is the last rank)")
    return bool(num_coordinators)


def _slices(training: list[int], num_agent_groups: object) -> list[list[int]]:
    """torchgfn's ``agent_group_rank_list``: ``num_agent_groups`` consecutive, equal slices of ``training``."""
    if not _is_int(num_agent_groups) or not 1 <= int(num_agent_groups) <= max(1, len(training)) \
            or len(training) % int(num_agent_groups):
        divisors = [d for d in range(1, len(training) + 1) if len(training) % d == 0]
        raise ConfigError(f"num_agent_groups={num_agent_groups!r} cannot split {len(training)} training ranks into "
                          f"equal groups: use one of {divisors}")
    size = len(training) // int(num_agent_groups)
    return [training[i * size:(i + 1) * size] for i in range(int(num_agent_groups))]


def _split(ranks: list[int], parts: int) -> list[list[int]]:
    """``ranks`` cut into ``parts`` consecutive chunks, the first ``len % parts`` one longer (torchgfn's
    per-node chunks of a layout without managers)."""
    base, extra = divmod(len(ranks), parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [ranks[bounds[i]:bounds[i + 1]] for i in range(parts)]


class RankLayout:
    """Rank layout for distributed training with optional buffer managers (torchgfn's names).

    Each buffer group is a set of agent ranks plus one manager rank. Use :meth:`build` for arithmetic
    assignment or :meth:`from_hostnames` for node-local assignment from every rank's host name; the
    constructor takes the lists themselves, which must give every rank of ``range(n)`` one role
    (ConfigError otherwise). ``native`` is the :class:`popmesh.topology.RankLayout` it stands for.
    """

    native: Layout

    def __init__(self, training_ranks: list[int], buffer_ranks: list[int], agent_ranks_per_group: list[list[int]],
                 num_agent_groups: int) -> None:
        training, buffers = _rank_list(training_ranks, "training_ranks"), _rank_list(buffer_ranks, "buffer_ranks")
        given: object = agent_ranks_per_group  # checked: callers pass anything
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise ConfigError(f"agent_ranks_per_group must be a list of rank lists, got {given!r}")
        per_group = [_rank_list(g, "an agent_ranks_per_group entry") for g in given]
        if sorted(r for g in per_group for r in g) != sorted(training):
            raise ConfigError(f"agent_ranks_per_group {per_group} must hold exactly the training ranks {training}")
        if buffers and len(per_group) != len(buffers):
            raise ConfigError(f"{len(buffers)} buffer ranks but {len(per_group)} agent_ranks_per_group entries: give "
                              "the agents of each manager, in the order of buffer_ranks")
        groups = _slices(training, num_agent_groups)
        native = Layout(world_size=max(training + buffers, default=-1) + 1, training_ranks=tuple(training),
                        buffer_ranks=tuple(buffers), served_ranks=tuple(map(tuple, per_group)) if buffers else (),
                        agent_groups=tuple(map(tuple, groups)))
        self._show(native, per_group)

    def _show(self, native: Layout, per_group: list[list[int]]) -> None:
        """Lay ``native`` out under torchgfn's attribute names and orders."""
        self.native = native
        self.training_ranks = [r for g in per_group for r in g]
        self.buffer_ranks = list(native.buffer_ranks)
        self.agent_ranks_per_group = per_group
        self.num_training_ranks = len(self.training_ranks)
        self.agent_group_size = native.agent_group_size
        self.buffer_rank_set = set(native.buffer_ranks)
        self.agent_group_rank_list = _slices(self.training_ranks, native.num_agent_groups)

    @classmethod
    def _of(cls, native: Layout, per_group: list[list[int]]) -> RankLayout:
        layout = cls.__new__(cls)
        layout._show(native, per_group)
        return layout

    def __repr__(self) -> str:
        return (f"RankLayout(training_ranks={self.training_ranks}, buffer_ranks={self.buffer_ranks}, agent_ranks_per_"
                f"group={self.agent_ranks_per_group}, num_agent_groups={len(self.agent_group_rank_list)})")

    # --- per-rank queries (torchgfn's answers for a rank outside the layout: None, None, 0) ----------------

    def _known(self, rank: object) -> bool:
        return _is_int(rank) and 0 <= int(rank) < self.native.world_size

    def assigned_buffer(self, rank: int) -> int | None:
        """Buffer manager rank for a training rank, or ``None``."""
        return self.native.assigned_buffer(rank) if self._known(rank) else None

    def assigned_training_ranks(self, rank: int) -> list[int] | None:
        """Training ranks managed by a buffer rank, or ``None``."""
        return self.native.assigned_training_ranks(rank) if self._known(rank) else None

    def agent_group_id(self, rank: int) -> int:
        """Agent-group ID of ``rank``; a manager reports its agents' group, the coordinator 0."""
        return self.native.agent_group_id(rank) if self._known(rank) else 0

    def summary(self, num_nodes: int) -> str:
        """Human-readable layout summary for logging (popmesh's: managers, served ranks, agent groups)."""
        return self.native.summary(num_nodes)

    # --- constructors ------------------------------------------------------------------------------------

    @classmethod
    def build(cls, world_size: int, num_remote_buffers: int, num_nodes: int, num_agent_groups: int,
              num_coordinators: int) -> RankLayout:
        """Build layout using arithmetic rank assignment (the coordinator, if any, is the last rank)."""
        native = Layout.build(world_size, num_remote_buffers, num_agent_groups, _coordinator(num_coordinators),
                              num_nodes=num_nodes)
        if native.buffer_ranks:
            return cls._of(native, [list(s) for s in native.served_ranks])
        return cls._of(native, _split(list(native.training_ranks), int(num_nodes)))

    @classmethod
    def from_hostnames(cls, world_size: int, num_remote_buffers: int, num_agent_groups: int, num_coordinators: int,
                       all_hostnames: list[str]) -> RankLayout:
        """Build layout from every rank's host name (``all_hostnames[r]`` is rank r's): node-local managers when
        ``num_remote_buffers`` is a multiple of the number of nodes, else :meth:`build`'s with a LayoutWarning."""
        given: object = all_hostnames  # checked: callers pass anything
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != world_size:
            raise ConfigError(f"all_hostnames must hold one host name per rank of the world_size={world_size!r} "
                              f"ranks, got {all_hostnames!r}")
        native = Layout.from_hostnames(list(all_hostnames), num_remote_buffers, num_agent_groups,
                                       _coordinator(num_coordinators))
        if native.buffer_ranks:
            return cls._of(native, [list(s) for s in native.served_ranks])
        nodes: dict[str, list[int]] = {}  # without managers: each node's training ranks, nodes by their first rank
        for rank, host in enumerate(all_hostnames):
            if rank != native.coordinator_rank:
                nodes.setdefault(host, []).append(rank)
        return cls._of(native, list(nodes.values()))


def native_layout(layout: Any, world_size: int, use_coordinator: bool) -> Layout:
    """popmesh's layout of a world of ``world_size`` for ``layout`` (the facade's or popmesh's own), the
    coordinator the last rank when ``use_coordinator``; ConfigError when it does not fit that world."""
    if isinstance(layout, Layout):
        native = layout
    elif isinstance(layout, RankLayout):
        native = layout.native
        if native.world_size != world_size or (native.coordinator_rank is not None) != use_coordinator:
            coordinator = world_size - 1 if use_coordinator else None
            native = Layout(world_size=world_size, training_ranks=native.training_ranks,
                            buffer_ranks=native.buffer_ranks, served_ranks=native.served_ranks,
                            agent_groups=native.agent_groups, coordinator_rank=coordinator)
    else:
        raise ConfigError(f"layout must be a RankLayout (popmesh.compat.gfn's or popmesh.topology's), got "
                          f"{type(layout).__name__}")
    if native.world_size != world_size or (native.coordinator_rank is not None) != use_coordinator:
        raise ConfigError(f"the layout is for {native.world_size} ranks with coordinator {native.coordinator_rank}, "
                          f"this world has {world_size} ranks and {'a' if use_coordinator else 'no'} coordinator: "
                          "build the layout for this world, or pass the num_coordinators it was built with")
    return native


def announced_by_mpi(environ: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """``(variables, rank, size)`` that an MPI process manager gave this process (``PMI_RANK``/``PMI_SIZE``,
    Open MPI's ``OMPI_COMM_WORLD_RANK``/``..._SIZE``, MVAPICH's ``MV2_COMM_WORLD_*``, PMIx's), as torchgfn reads
    them; None where no MPI launcher announced both."""
    environ = os.environ if environ is None else environ
    sized = launcher_world_size(environ)
    rank_variable = next((n for n in MPI_RANK_VARIABLES if environ.get(n, "").strip().isdecimal()), None)
    if sized is None or sized[0] == "SLURM_NTASKS" or rank_variable is None:
        return None
    return f"{rank_variable}/{sized[0]}", int(environ[rank_variable]), sized[1]


def check_announced(rank: int, size: int, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError where a formed world's ``rank`` of ``size`` is not what the MPI launcher announced: its mpi4py
    then runs another MPI than the launcher's (e.g. Open MPI's mpirun over MPICH's mpi4py, where every process
    is a world of one), or stale ``RANK``/``WORLD_SIZE`` variables overrode the launch."""
    announced = announced_by_mpi(environ)
    if announced is None or announced[1:] == (rank, size):
        return
    names, want_rank, want_size = announced
    raise ConfigError(f"{names} announce rank {want_rank} of {want_size}, but this world formed as rank {rank} of "
                      f"{size}: mpi4py's MPI is not the launcher's (launch with the mpiexec of mpi4py's MPI, e.g. "
                      "`popmesh launch -n N --engine mpi script.py`, or build mpi4py against the launcher's MPI), or "
                      "RANK/WORLD_SIZE were left set: unset them")
