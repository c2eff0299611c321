"""The demo's population when its world changes: newcomers seeded from the best agents, and what rank 0
records of it.

A newcomer is a process restarted for a lost rank (``--max-restarts N``: it *rejoins*), or, in an elastic
world (``popmesh demo --nnodes MIN:MAX``), one of a later launcher's ranks (it *joins*, and then explores
from what it inherited, so it brings diversity of its own); a rank lost with no restart left *leaves* for
good, and the ranks above it move down. Agents are named by their launcher number throughout
(:mod:`popmesh.demo.membership`). Every function here that takes ``world`` is collective over it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import popmesh
from popmesh.core.errors import ConfigError, PeerClosed, PeerFailure
from popmesh.demo.config import DemoConfig, explore_hyper
from popmesh.demo.learner import PPOLearner
from popmesh.demo.membership import (
    agent_of,
    agents_of,
    change,
    joined_events,
    last_steps,
    left_events,
    sizes_seen,
)
from popmesh.demo.reporter import Reporter
from popmesh.population.state.rejoin import seed_newcomers

__all__ = ["Alone", "after_reform", "anyone_waiting", "before_reform", "exploit", "explore_agent", "goes_on",
           "seed"]


class Alone(NamedTuple):
    """What one member did while the world was short of a lost rank (zeros on a newcomer)."""

    iterations: int = 0  # trained on without the lost rank
    waited_s: float = 0.0  # waiting for the other members to re-form
    leaving_s: float = 0.0  # leaving the broken world and forming survivors' groups


def before_reform(world: Any, iteration: int, lost_at: float | None = None) -> dict[str, Any]:
    """What a member knows before a re-form that the newcomers and rank 0 need after it (JSON values): the
    roster (who joined, rejoined or left), and when and at which iteration it saw a loss."""
    return {"roster": list(world.roster), "time": lost_at, "iteration": iteration}


def goes_on(world: Any, config: DemoConfig, error: PeerFailure) -> bool:
    """Whether an elastic world resolves ``error`` (met while the world was whole) by forming its next
    generation at once: a process waits to join (the ranks that noticed it re-form, and their leaving broke
    this generation's traffic), or a rank was lost with no restart to wait for (it leaves for good). A peer
    that closed in order with nobody waiting has finished: not a loss to go on from."""
    if not config.elastic:
        return False
    if world.newcomer_waiting():
        return True
    return not config.max_restarts and not isinstance(error, PeerClosed)


def anyone_waiting(world: Any) -> bool:
    """Every rank, at the end of an elastic run (an all-reduce, so also the run's last barrier): whether any
    rank sees a process waiting to join, or a rank marked left (then all re-form before they finish)."""
    return bool(popmesh.all_reduce(np.array([int(world.newcomer_waiting())]), "max")[0])


def after_reform(world: Any, config: DemoConfig, learner: PPOLearner, reporter: Reporter, iteration: int,
                 before: dict[str, Any], out: Path, alone: Alone | None = None) -> tuple[int, Path, int]:
    """Every member, right after the world re-formed (``before``: :func:`before_reform`, this rank's): seed the
    newcomers (:func:`seed`), or, with none, record the ranks that left. The iteration this rank goes on
    from, the run's folder, and the highest iteration of any rank (no checkpoint or lockstep decision up
    to it: ranks re-formed from different iterations)."""
    reporter.sizes = sizes_seen(reporter.sizes, world.size)
    if world.newcomers:
        return seed(world, config, learner, reporter, iteration, before, out, alone)
    if world.is_main:
        gone = change(before["roster"], world.roster, ()).left
        for event in left_events(gone, time=time.time(), iteration=iteration, generation=world.generation,
                                 world_size=world.size, last_steps=last_steps(reporter.history)):
            reporter.survival(event)
    return iteration, out, int(popmesh.all_reduce(np.array([iteration]), "max")[0])


def seed(world: Any, config: DemoConfig, learner: PPOLearner, reporter: Reporter, iteration: int,
         before: dict[str, Any] | None, out: Path | None, alone: Alone | None = None) -> tuple[int, Path, int]:
    """Every rank, right after the world (re-)formed with newcomers (a newcomer passes ``before`` and ``out``
    as None): they take the mean of the best agents (PBT's exploit), the best one's counters, and the run's
    folder; a newcomer that joined (its launcher number is new) then explores its learning rate and entropy
    coefficient. Rank 0 records the change: a rejoin (and the loss before it, ``before["time"]``: when a
    survivor saw it) with what each member did meanwhile (``alone``), a join with the newcomers' explored
    values, a leave. Returns as :func:`after_reform`."""
    seen_at = iteration  # this rank's, unless the donor says where a survivor saw the loss
    seeding, iteration = exploit(world, config, learner, iteration)
    if seeding is None:
        raise ConfigError("the world re-formed without a new process: nothing to seed")
    donor = seeding.donors[0]
    known = popmesh.broadcast_object(before, src=donor)  # a member's roster before, and what it saw
    out = Path(popmesh.broadcast_object(None if out is None else str(out), src=donor))
    changed = change(known["roster"], world.roster, world.newcomers)
    me = agent_of(world.roster, world.rank)
    explored = explore_agent(config, learner, me, iteration) if me in changed.joined else None
    gathered = popmesh.gather_object({"alone": list(alone or Alone()), "explored": explored}, dst=0) or []
    if world.is_main:
        now, steps = time.time(), int(seeding.counters["steps"])
        donors = agents_of(world.roster, seeding.donors)
        alone_by_rank = [Alone(*g["alone"]) for g in gathered]
        lost_at, lost_iteration = known.get("time"), known.get("iteration", seen_at)
        for agent in changed.rejoined:
            reporter.survival({"kind": "lost", "rank": agent, "time": lost_at or now, "iteration": lost_iteration,
                               "steps": steps})
            reporter.survival({"kind": "rejoined", "rank": agent, "time": now, "iteration": iteration, "steps": steps,
                               "donors": donors, "weights": list(seeding.weights), "generation": world.generation,
                               "downtime_s": round(now - (lost_at or now), 3),
                               "iterations_alone": [a.iterations for a in alone_by_rank],
                               "survivor_wait_s": [round(a.waited_s, 3) for a in alone_by_rank],
                               "survivor_leaving_s": [round(a.leaving_s, 3) for a in alone_by_rank]})
        by_agent = {agent_of(world.roster, rank): g["explored"] for rank, g in enumerate(gathered)}
        for event in joined_events(changed.joined, donors, seeding.weights, time=now,
                                   iteration=int(seeding.counters["iteration"]), steps=steps,
                                   generation=world.generation, world_size=world.size, explored=by_agent):
            reporter.survival(event)
        for event in left_events(changed.left, time=now, iteration=iteration, generation=world.generation,
                                 world_size=world.size, last_steps=last_steps(reporter.history)):
            reporter.survival(event)
    through = int(popmesh.all_reduce(np.array([iteration]), "max")[0])
    return iteration, out, through


def exploit(world: Any, config: DemoConfig, learner: PPOLearner, iteration: int,
            newcomers: tuple[int, ...] | None = None) -> tuple[Any, int]:
    """PBT's exploit for the newcomers (``world.newcomers``, or the ranks given): :func:`seed_newcomers`, and a
    newcomer takes its best donor's step count and the explored values that came with the weights. The
    seeding (None when no rank is new) and the iteration this rank goes on from (a newcomer's is its best
    donor's)."""
    seeding = seed_newcomers(learner.model, learner.optimizer, learner.mean_return(),
                             {"iteration": iteration, "steps": learner.total_steps}, donors=config.donors,
                             newcomers=newcomers)
    if seeding is not None and world.rank in seeding.newcomers:
        learner.total_steps = int(seeding.counters["steps"])
        learner.adopt_hyper()
        learner.adopt_returns()
        iteration = int(seeding.counters["iteration"])
    return seeding, iteration


def explore_agent(config: DemoConfig, learner: PPOLearner, agent: int, iteration: int) -> dict[str, Any]:
    """An agent that took others' weights trains at the values that came with them (PBT's exploit), moved by
    the explore step for those ``--explore`` names, seeded by (``--seed``, ``agent``: its launcher number,
    ``iteration``). What its event keeps: each value inherited and in use (``lr_inherited``, ``lr``,
    ``ent_coef_inherited``, ``ent_coef``) and the names that changed."""
    learner.adopt_hyper()
    inherited = learner.explored()
    if config.explore:
        learner.set_hyper(**explore_hyper(inherited, config.explore, config.declarations(), config.seed, agent,
                                          iteration))
    now = learner.explored()
    return {**{f"{name}_inherited": value for name, value in inherited.items()}, **now,
            "explored": [name for name in now if now[name] != inherited[name]]}
