"""Who is in the demo's population while its world grows and shrinks (pure functions over rosters).

An agent's identity is its launcher number, ``world.roster[world.rank]``: a re-form keeps it while it
renumbers the ranks above one that left (``popmesh launch --nnodes MIN:MAX``). Rows, events, the history
and the summary name agents by it; in a world of fixed size the roster is ``0..N-1`` and it is the rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Change", "agent_of", "agents_of", "change", "joined_events", "kill_due", "last_steps", "left_events",
           "sizes_seen", "steps_goal", "summary_lines"]


class Change(NamedTuple):
    """What a re-form changed, in launcher numbers: agents new to the population (a later launcher's
    ranks), agents restarted for a lost rank (back in their place), and agents gone for good."""

    joined: tuple[int, ...] = ()
    rejoined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()


def agent_of(roster: Sequence[int], rank: int) -> int:
    """The launcher number of ``rank`` in a world whose roster is ``roster``."""
    return int(roster[rank])


def agents_of(roster: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """:func:`agent_of` for each of ``ranks`` (donors, newcomers), in order."""
    return [agent_of(roster, rank) for rank in ranks]


def change(before: Sequence[int], after: Sequence[int], newcomers: Sequence[int]) -> Change:
    """The change from the roster ``before`` a re-form to the roster ``after`` it, whose ranks
    ``newcomers`` are new processes: a newcomer whose number was in ``before`` was restarted (it
    rejoins), any other joined; a number of ``before`` missing from ``after`` left."""
    fresh = agents_of(after, sorted(newcomers))
    was = set(before)
    return Change(tuple(a for a in fresh if a not in was), tuple(a for a in fresh if a in was),
                  tuple(a for a in before if a not in set(after)))


def sizes_seen(sizes: Sequence[int], size: int) -> list[int]:
    """The world sizes a run went through, with ``size`` added unless it is the latest already."""
    return [*sizes, size] if not sizes or sizes[-1] != size else list(sizes)


def joined_events(joined: Sequence[int], donors: Sequence[int], weights: Sequence[float], *, time: float,
                  iteration: int, steps: int, generation: int, world_size: int,
                  explored: Mapping[int, Mapping[str, Any] | None]) -> list[dict[str, Any]]:
    """One ``"joined"`` event per agent of ``joined`` (launcher numbers): seeded from ``donors`` (launcher
    numbers) with ``weights`` at ``iteration``/``steps`` (its best donor's), into a world of ``world_size``
    at ``generation``; ``explored[agent]``: what its explore step did (the values inherited and in use,
    and the names it moved, as a replaced agent's event keeps them)."""
    return [{"kind": "joined", "rank": agent, "time": time, "iteration": iteration, "steps": steps,
             "donors": list(donors), "weights": list(weights), "generation": generation, "world_size": world_size,
             "newcomers": list(joined), **(explored.get(agent) or {"explored": []})} for agent in joined]


def left_events(left: Sequence[int], *, time: float, iteration: int, generation: int, world_size: int,
                last_steps: Mapping[int, int]) -> list[dict[str, Any]]:
    """One ``"left"`` event per agent of ``left`` (launcher numbers), gone for good: noticed at
    ``iteration`` (the reporting rank's), the world going on with ``world_size`` ranks at ``generation``;
    ``steps`` is the agent's last reported step count (None if it never reported)."""
    return [{"kind": "left", "rank": agent, "time": time, "iteration": iteration, "steps": last_steps.get(agent),
             "generation": generation, "world_size": world_size} for agent in left]


def kill_due(kill: tuple[int, int] | None, agent: int, iteration: int, restart_count: int) -> bool:
    """``--kill AGENT:ITERATION``: whether this process (launcher number ``agent``, at ``iteration``, in its
    ``restart_count``-th life) kills itself now. Only the first life does, so a restart trains on."""
    return kill == (agent, iteration) and restart_count == 0


def steps_goal(total_steps: int, steps: Mapping[int, int], left: Sequence[int]) -> int:
    """The env steps the population will have taken at the end: ``total_steps`` per agent, except that
    an agent that left stays at the steps it had (``steps``: each agent's latest)."""
    gone = set(left)
    return sum(steps.get(agent, 0) if agent in gone else total_steps for agent in steps)


def last_steps(history: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Each agent's latest step count in ``history`` (rows with ``rank`` and ``steps``)."""
    latest: dict[int, int] = {}
    for row in history:
        latest[row["rank"]] = max(latest.get(row["rank"], 0), int(row["steps"]))
    return latest


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """What the end of the run says of an elastic world's joins and leaves (``summary.json``'s ``joined``,
    ``left`` and ``world_sizes``); nothing for a world of fixed size."""
    lines = []
    for event in summary.get("joined", ()):
        moved = ", ".join(f"{n} {event[f'{n}_inherited']:.1e} → {event[n]:.1e}" for n in event.get("explored", ()))
        lines.append(f"rank {event['rank']} joined at iteration {event['iteration']} (a world of "
                     f"{event['world_size']}), seeded by mean({', '.join(f'rank {d}' for d in event['donors'])})"
                     + (f", then explored: {moved}" if moved else ""))
    for event in summary.get("left", ()):
        lines.append(f"rank {event['rank']} left for good at iteration {event['iteration']}; the others went on, a "
                     f"world of {event['world_size']}")
    if len(summary.get("world_sizes", ())) > 1:
        lines.append("world sizes: " + " → ".join(map(str, summary["world_sizes"])))
    return lines
