"""What a demo rank does when the world changes under it: a rank lost (leave the broken world, train on
among the survivors or alone) and the next generation formed (a restarted rank back, a later launcher's
ranks joining, a rank gone for good)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import popmesh
from popmesh.core.errors import PeerClosed, PeerFailure, PopmeshError
from popmesh.demo.config import DemoConfig
from popmesh.demo.elastic import Alone, after_reform, before_reform
from popmesh.demo.learner import PPOLearner
from popmesh.demo.policies import make_policy
from popmesh.demo.reporter import Reporter
from popmesh.observe.reports import Timer
from popmesh.population.mechanisms.asynchronous.protocol import MAX_INSTANCES
from popmesh.population.state.checkpoint import Checkpointer

__all__ = ["Lost", "leave", "lockstep", "regroup", "reform", "shut_down"]


@dataclass
class Lost:
    """What a survivor keeps while the world is short of a lost rank: when it saw the loss, its policy's
    state (the policy is made again in the next generation), the iterations trained since, and the
    survivors' group with the population policy among them (None: this rank trains on alone)."""

    at: float
    iteration: int
    policy_state: dict[str, Any] | None
    iterations: int = 0
    group: Any = None
    policy: Any = None
    regroups: int = 0
    policy_from: int = 0  # the survivors' policy acts from this iteration on (see the worker's training loop)
    leaving_s: float = 0.0  # seconds spent leaving the broken world and forming survivors' groups

    @property
    def members(self) -> tuple[int, ...]:
        return () if self.group is None else tuple(self.group.ranks)


def leave(world: Any, config: DemoConfig, learner: PPOLearner, policy: Any, reporter: Reporter,
           error: PeerFailure, timer: Timer, iteration: int, lost: Lost | None, checkpoints: Checkpointer) -> Lost:
    """A rank was lost: stop what lives on the broken world (the policy, keeping its state; the reporter's
    messages) and go on with the other survivors (``regroup``); ``error`` again when nothing restarts
    lost ranks. ``lost``: the survivors' state when this is a further failure while the world is short."""
    if not config.max_restarts or isinstance(error, PeerClosed):
        raise error
    if lost is not None and world.failure(lost.members) is None:
        return lost  # no member of the survivors' group is lost: one of them went on to re-form, as this rank will
    began = time.monotonic()
    with timer.section("re-forming"):
        if lost is None:
            lost = Lost(time.time(), iteration, policy.state_dict() if hasattr(policy, "state_dict") else None)
            shut_down(policy)  # its thread already stopped on the loss; this surfaces why
            reporter.detach()
        regroup(world, config, learner, lost, iteration, checkpoints)
    lost.leaving_s += time.monotonic() - began
    return lost


def lockstep(config: DemoConfig) -> bool:
    """Whether the policy decides in lockstep (collectives at the same iteration on every rank)."""
    return config.policy in ("selective", "average-all")


def regroup(world: Any, config: DemoConfig, learner: PPOLearner, lost: Lost, iteration: int,
             checkpoints: Checkpointer) -> None:
    """Form the survivors' group and a population policy among them, on a channel of its own (frames of the
    old policy may still be unreceived). Its replacement rules start afresh: what the whole population's
    remembered is per member, and is taken back at the rejoin. The survivors noticed the loss at different
    iterations: their next checkpoint is one past the furthest, which all of them reach. If the survivors
    cannot agree on a group, this rank trains on alone."""
    if lost.policy is not None:
        shut_down(lost.policy)
    lost.group = lost.policy = None
    try:
        group = world.survivors()
    except PopmeshError as e:
        print(f"rank {world.rank}: the survivors formed no group ({e}); training on alone", file=sys.stderr,
              flush=True)
        return
    lost.regroups += 1
    if group.size > 1:
        lost.group = group
        lost.policy = make_policy(config, learner, channel=1 + (lost.regroups - 1) % (MAX_INSTANCES - 1))
        furthest = int(popmesh.all_reduce(np.array([iteration]), "max", group=group)[0])
        checkpoints.skip_through(furthest)
        if lockstep(config):
            lost.policy_from = furthest


def shut_down(policy: Any) -> None:
    """End an asynchronous policy's traffic (a failure it met is already known: ignore it)."""
    if hasattr(policy, "shutdown"):
        try:
            policy.shutdown(timeout=5.0)
        except PopmeshError:
            pass


def reform(world: Any, config: DemoConfig, learner: PPOLearner, reporter: Reporter, iteration: int, out: Path,
            checkpoints: Checkpointer, lost: Lost | None, policy: Any) -> tuple[Any, int]:
    """Form the next generation of the world: a process waits to join (restarted for a lost rank, or in an
    elastic world a later launcher's), or a rank left for good. Wind down the policy (the survivors' one,
    ``lost``, while the world was short), re-form (waiting only for the other members to get here), rebuild
    what lived on the old generation (the policy on channel 0, keeping its state where the members are the
    same ones; the reporter's receives) and seed the newcomers (:func:`after_reform`). This rank keeps its
    agent and iteration. Returns the new policy and the iteration it acts from (see the worker's training
    loop). What this rank waited for the others is recorded. ``WorldTooSmall`` (below MIN nodes) ends the run."""
    if lost is None:
        shut_down(policy)  # the asynchronous one's coordinator takes every rank's goodbye within an iteration
        reporter.detach()
        before, state = before_reform(world, iteration), None
    else:
        shut_down(lost.policy)
        before, state = before_reform(world, lost.iteration, lost.at), lost.policy_state
    began = time.monotonic()
    world.reform()
    waited = time.monotonic() - began
    policy = make_policy(config, learner)
    if state and policy is not None and hasattr(policy, "load_state_dict") and list(world.roster) == before["roster"]:
        policy.load_state_dict(state)  # its rules remember members by rank: only for the same members
    reporter.reconnect()
    alone = Alone(lost.iterations, waited, lost.leaving_s) if lost else Alone(0, waited, 0.0)
    through = after_reform(world, config, learner, reporter, iteration, before, out, alone)[2]
    checkpoints.skip_through(through)
    return policy, through if lockstep(config) else 0
