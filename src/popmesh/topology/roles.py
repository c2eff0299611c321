"""Roles to groups: the :class:`Roles` of a world split by a :class:`~popmesh.topology.layout.RankLayout`.

:func:`assign_roles` turns a pure layout (training ranks in agent groups, replay-buffer managers, an
optional coordinator) into Groups, the same code on every engine. It is collective: **every rank of
the world must call it, with the same arguments**; groups are created in one fixed order (agent
groups, then the training group, then the buffer group), and a rank list already created is reused
rather than created twice (one agent group of all trainers *is* the training group).

Attribute names and meanings mirror torchgfn's ``DistributedContext`` (whose facade,
:mod:`popmesh.compat.gfn`, subclasses :class:`Roles`), with global ranks throughout. Deliberate
differences: groups are popmesh Groups (every rank holds every group; ``is_member`` says whether it
belongs), one object serves torch and MPI alike (no second mpi4py context that must line up by
rank), and :meth:`~Roles.cleanup` leaves the world up (torchgfn's called ``MPI.Finalize``; end the
world with ``popmesh.finalize()``).

In an elastic world (``popmesh launch --nnodes MIN:MAX``) roles follow the processes across a change
of size: :meth:`Roles.rebuild` turns the layout into the new generation's
(:func:`~popmesh.topology.elastic.relayout`: managers and the coordinator keep their roles, newcomers
train), and a newcomer's :func:`assign_roles` receives that layout from the ranks already there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from popmesh.comm.collectives import all_gather_object, broadcast_object
from popmesh.comm.world import Group, World
from popmesh.core.errors import ConfigError
from popmesh.topology.elastic import relayout, renumbering
from popmesh.topology.layout import RankLayout

__all__ = ["Roles", "assign_roles"]


@dataclass(eq=False)
class Roles:
    """Who does what in a world, and the groups each role communicates over.

    ``agent_groups`` holds every agent group (in layout order) on every rank; ``agent_group_id`` is
    this rank's group index (for a manager, the group of its first agent; 0 for the coordinator).
    ``train_global_group`` spans all training ranks; ``buffer_group`` all managers (None without
    buffers). ``assigned_buffer`` is the manager serving this training rank (None elsewhere);
    ``assigned_training_ranks`` the agents this manager serves (None elsewhere). ``roster``: the
    launcher number of each rank when the roles were last made; after a :meth:`rebuild` that changed
    the world's size, ``renumbered`` maps each old rank still there to its new rank (else identity).
    """

    world: World
    layout: RankLayout
    my_rank: int
    world_size: int
    num_training_ranks: int
    agent_group_size: int
    agent_groups: list[Group]
    agent_group_id: int
    train_global_group: Group
    assigned_buffer: int | None = None
    assigned_training_ranks: list[int] | None = None
    buffer_group: Group | None = None
    buffer_rank_set: set[int] = field(default_factory=set)
    coordinator_rank: int | None = None
    training_ranks: list[int] = field(default_factory=list)
    roster: tuple[int, ...] = ()
    renumbered: dict[int, int] = field(default_factory=dict)
    _closed: bool = field(default=False, repr=False)
    _layout_given: bool = field(default=False, repr=False)

    def is_training_rank(self) -> bool:
        """True on ranks that train agents."""
        return self.my_rank in self.training_ranks

    def is_buffer_rank(self) -> bool:
        """True on replay-buffer manager ranks."""
        return self.my_rank in self.buffer_rank_set

    def is_coordinator_rank(self) -> bool:
        """True on the coordinator rank (if there is one)."""
        return self.coordinator_rank is not None and self.my_rank == self.coordinator_rank

    @property
    def agent_group(self) -> Group | None:
        """This training rank's agent group (None on managers and the coordinator)."""
        return self.agent_groups[self.agent_group_id] if self.is_training_rank() else None

    def rebuild(self) -> None:
        """After ``world.reform()``: make the groups of the new generation, collective over the world.
        Every survivor calls this where the restarted process calls :func:`assign_roles` with the same
        arguments: both make the same calls in the same order. In an elastic world the layout first
        follows the change of size (:func:`~popmesh.topology.elastic.relayout`), and the lowest survivor
        sends it to the newcomers' :func:`assign_roles`; :attr:`renumbered` says where each rank went."""
        world = self.world
        if world.elastic:
            layout = relayout(self.layout, self.roster, world.roster, world.hostnames)
            self.renumbered = renumbering(self.roster, world.roster)
            self._take(_share_layout(world, layout))
        elif self._layout_given:
            _check_layout(world, self.layout)
        self.agent_groups, self.train_global_group, self.buffer_group = _make_groups(world, self.layout)
        self._closed = False

    def _take(self, layout: RankLayout) -> None:
        """This rank's roles in ``layout``, a layout of the current generation."""
        for name, value in _roles_in(self.world, layout).items():
            setattr(self, name, value)

    def cleanup(self) -> None:
        """Forget the groups (idempotent); the world stays up (end it with ``popmesh.finalize()``).

        Local only: no rank waits for the others here, so end with a barrier first if ranks must
        agree they are done.
        """
        if self._closed:
            return
        self._closed = True
        self.agent_groups = []
        self.buffer_group = None


def assign_roles(world: World, layout: RankLayout | None = None, *, num_buffers: int = 0,
                 num_agent_groups: int = 1, use_coordinator: bool = False) -> Roles:
    """Split ``world`` into roles and create their groups; collective over the whole world.

    Without ``layout`` one is built: node-aware from ``world.hostnames`` when there are buffer
    managers (each manager on its agents' node), else arithmetic. A ``layout`` passed in must have
    ``world.size`` ranks and is checked to be the same on every rank (one all_gather_object).
    After ``world.reform()`` survivors call :meth:`Roles.rebuild` where a restarted process calls this;
    in an elastic world such a newcomer takes the layout the survivors' ``rebuild`` sends it (its own
    arguments are not used then).
    """
    given = layout is not None
    if world.elastic and world.rank in world.newcomers:
        layout = _share_layout(world, None)
    elif layout is None:
        if num_buffers > 0:
            layout = RankLayout.from_hostnames(world.hostnames, num_buffers, num_agent_groups, use_coordinator)
        else:
            layout = RankLayout.build(world.size, 0, num_agent_groups, use_coordinator, num_nodes=world.num_nodes)
    else:
        _check_layout(world, layout)
    agent_groups, training, buffers = _make_groups(world, layout)
    return Roles(world=world, agent_groups=agent_groups, train_global_group=training, buffer_group=buffers,
                 renumbered={r: r for r in range(world.size)}, _layout_given=given, **_roles_in(world, layout))


def _roles_in(world: World, layout: RankLayout) -> dict[str, Any]:
    """The fields of this rank's :class:`Roles` that ``layout`` decides (not its groups)."""
    rank = world.rank
    return {"layout": layout, "my_rank": rank, "world_size": layout.world_size, "roster": world.roster,
            "num_training_ranks": layout.num_training_ranks, "agent_group_size": layout.agent_group_size,
            "agent_group_id": layout.agent_group_id(rank), "assigned_buffer": layout.assigned_buffer(rank),
            "assigned_training_ranks": layout.assigned_training_ranks(rank),
            "buffer_rank_set": set(layout.buffer_ranks), "coordinator_rank": layout.coordinator_rank,
            "training_ranks": list(layout.training_ranks)}


def _share_layout(world: World, layout: RankLayout | None) -> RankLayout:
    """The lowest rank that is not new in this generation sends its ``layout`` to every rank (a newcomer
    passes None); every rank gets it back, checked."""
    kept = [r for r in range(world.size) if r not in world.newcomers]
    if not kept:
        raise ConfigError("every rank of this world is new: there are no roles to take over; call assign_roles "
                          "with the layout's arguments instead")
    src = kept[0]
    sent = broadcast_object(layout.to_dict() if world.rank == src and layout is not None else None, src=src,
                            group=world)
    return RankLayout.from_dict(sent)


def _make_groups(world: World, layout: RankLayout) -> tuple[list[Group], Group, Group | None]:
    """The agent groups, the training group and the buffer group, created in that order; a rank list
    already created is reused."""
    groups: dict[tuple[int, ...], Group] = {}

    def group_of(ranks: tuple[int, ...]) -> Group:
        if ranks not in groups:
            groups[ranks] = world.new_group(ranks)
        return groups[ranks]

    agent_groups = [group_of(g) for g in layout.agent_groups]
    training = group_of(layout.training_ranks)
    return agent_groups, training, group_of(tuple(layout.buffer_ranks)) if layout.buffer_ranks else None


def _check_layout(world: World, layout: RankLayout) -> None:
    if layout.world_size != world.size:
        raise ConfigError(f"the layout is for {layout.world_size} ranks but the world has {world.size}: "
                          "build it with world_size=world.size")
    if world.size == 1:
        return
    mine = layout.to_dict()
    everyone = all_gather_object(mine, group=world)
    differ = [r for r, other in enumerate(everyone) if other != mine]
    if differ:
        raise ConfigError(f"ranks {differ} passed a different RankLayout than rank {world.rank}: build the layout "
                          "the same way on every rank (or on one rank and broadcast layout.to_dict())")
