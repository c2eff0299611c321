"""The roles of a world that changed size (``popmesh launch --nnodes MIN:MAX``): pure decisions.

When ranks join a running world, or leave it for good, its ranks are renumbered (the newcomers after
the ranks already there; the ranks above one that left move down). A replay-buffer manager must keep
its store and a coordinator its modes, so roles follow the processes, not the numbers: every process
keeps its role, each newcomer trains, and is served by the manager that serves the fewest agents
(preferring one on its own host). A process is named by its launcher number (``world.roster``), which
no re-form changes.

A manager or coordinator that left for good took what it held with it; :func:`relayout` then raises a
ConfigError that says so, on every rank alike, since nothing can be served on without losing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from popmesh.core.errors import ConfigError
from popmesh.topology.layout import RankLayout

__all__ = ["relayout", "renumbering"]


def renumbering(before: Sequence[int], after: Sequence[int]) -> dict[int, int]:
    """Each rank of the old generation still there -> its rank in the new one, from the two rosters
    (the launcher number of each rank, in rank order)."""
    where = {slot: rank for rank, slot in enumerate(after)}
    return {rank: where[slot] for rank, slot in enumerate(before) if slot in where}


def relayout(layout: RankLayout, before: Sequence[int], after: Sequence[int],
             hostnames: Sequence[str] | None = None) -> RankLayout:
    """``layout`` (of the generation whose roster was ``before``) for the generation whose roster is
    ``after``: every remaining process keeps its role, training ranks that left drop out of their
    manager's and agent group's lists, and each newcomer (in ``after`` only) trains, served by the
    manager with the fewest agents (on the newcomer's host first, where ``hostnames`` of the new
    generation are given; ties: the lower rank), in the smallest agent group (ties: the first)."""
    if len(before) != layout.world_size:
        raise ConfigError(f"the roster before has {len(before)} ranks but the layout {layout.world_size}")
    moved = renumbering(before, after)
    _check_services_stayed(layout, before, moved)
    newcomers = [rank for rank in range(len(after)) if after[rank] not in set(before)]
    served = [[moved[r] for r in agents if r in moved] for agents in layout.served_ranks]
    managers = [moved[m] for m in layout.buffer_ranks]
    groups = [[moved[r] for r in members if r in moved] for members in layout.agent_groups]
    for rank in newcomers:
        if managers:
            served[_fewest(served, managers, rank, hostnames)].append(rank)
        smallest = min(range(len(groups)), key=lambda g: (len(groups[g]), g))
        groups[smallest].append(rank)
    training = sorted([moved[r] for r in layout.training_ranks if r in moved] + newcomers)
    if not training:
        raise ConfigError("every training rank left the world for good: nothing is left to train")
    empty = [managers[i] for i, agents in enumerate(served) if not agents]
    if empty:
        raise ConfigError(f"the replay-buffer manager(s) at rank(s) {empty} of the new world would serve no agent: "
                          "every agent they served left for good. Start agents again with a later launcher, or "
                          "give the world fewer managers")
    sizes = {len(g) for g in groups if g}
    if len(sizes) > 1:
        raise ConfigError(f"the agent groups would have {sorted(len(g) for g in groups)} members after ranks joined or "
                          "left: an elastic world keeps its agent groups equal, so grow and shrink it by a multiple of "
                          f"num_agent_groups ({len(groups)}), or use one agent group")
    coordinator = None if layout.coordinator_rank is None else moved[layout.coordinator_rank]
    return RankLayout(world_size=len(after), training_ranks=tuple(training), buffer_ranks=tuple(managers),
                      served_ranks=tuple(tuple(s) for s in served), agent_groups=tuple(tuple(g) for g in groups if g),
                      coordinator_rank=coordinator)


def _check_services_stayed(layout: RankLayout, before: Sequence[int], moved: Mapping[int, int]) -> None:
    """ConfigError naming a manager or the coordinator that left for good (what it held is gone)."""
    gone = [r for r in layout.buffer_ranks if r not in moved]
    if gone:
        raise ConfigError(f"the replay-buffer manager(s) {[f'rank {r} (launcher rank {before[r]})' for r in gone]} "
                          "left the world for good, and the batches they stored with them: an elastic world keeps "
                          "its managers, so give them restarts (--max-restarts) or run them on node 0")
    if layout.coordinator_rank is not None and layout.coordinator_rank not in moved:
        raise ConfigError(f"the replay-buffer coordinator (rank {layout.coordinator_rank}, launcher rank "
                          f"{before[layout.coordinator_rank]}) left the world for good, and the modes it counted "
                          "with it: an elastic world keeps its coordinator, so give it restarts (--max-restarts) "
                          "or run it on node 0")


def _fewest(served: list[list[int]], managers: list[int], rank: int, hostnames: Sequence[str] | None) -> int:
    """The index of the manager that takes newcomer ``rank``: on its host if any is, then fewest agents,
    then the lower rank."""
    def key(i: int) -> tuple[bool, int, int]:
        elsewhere = hostnames is not None and hostnames[managers[i]] != hostnames[rank]
        return elsewhere, len(served[i]), managers[i]

    return min(range(len(managers)), key=key)
