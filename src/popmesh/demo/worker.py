"""One rank of the demo: a PPO agent on a gymnasium task, a population policy, and (on rank 0) the view.

Launched by ``popmesh demo`` as ``python -m popmesh.demo.worker --config '<json>'`` on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import popmesh
from popmesh.core import trace
from popmesh.core.errors import ConfigError, PeerFailure
from popmesh.demo import survival
from popmesh.demo.config import DemoConfig, rank_hyper, rank_seed
from popmesh.demo.elastic import anyone_waiting, exploit, explore_agent, goes_on, seed
from popmesh.demo.learner import PPOLearner
from popmesh.demo.membership import agent_of, agents_of, kill_due
from popmesh.demo.outputs import new_run_dir, plot_returns, print_summary, read_history, write_jsonl, write_summary
from popmesh.demo.policies import make_policy
from popmesh.demo.reporter import Reporter
from popmesh.demo.view import PopulationView
from popmesh.observe.board import Board
from popmesh.observe.reports import Timer
from popmesh.observe.timing import report_imbalance, report_timings
from popmesh.population.mechanisms.sharing import SampleSharing
from popmesh.population.state.checkpoint import Checkpointer, latest_checkpoint, load_agent, missing_ranks

__all__ = ["make_policy", "run", "main"]


def run(config: DemoConfig) -> dict[str, Any] | None:
    """Train until each agent has taken ``config.steps`` steps (or the target is hit, if asked)."""
    import torch

    torch.set_num_threads(1)
    # The agent is built before the world forms where its launcher number is known (RANK, torch engine): a
    # newcomer then joins ready, and the running ranks do not wait a second for it in the seeding.
    named = os.environ.get("RANK", "") if config.engine == "torch" else ""
    learner = _agent(config, int(named)) if named.isdigit() else None
    world = popmesh.init(engine=config.engine)
    if learner is None:  # named by the launcher's number, which a re-form keeps while ranks renumber
        learner = _agent(config, agent_of(world.roster, world.rank))
    policy = make_policy(config, learner)
    # rank 0 holds the terminal when the launcher gave it; under mpiexec its stdout is a pipe to the user's
    live = config.live and (sys.stdout.isatty() or (config.terminal and config.engine == "mpi"))
    view = PopulationView(world.size, config.steps, config.policy, env=config.env, live=live,
                          plain=config.live and not live, agents=tuple(world.roster)) if world.is_main else None
    reporter = Reporter(world, view, config.target, config.stop_at_target, at_checkpoints=config.checkpoint_every > 0)
    if world.newcomers:  # restarted for a lost rank, or a later launcher's (elastic): the population seeds it
        start, out, through = seed(world, config, learner, reporter, 0, None, None)
        resumed: dict[str, Any] | None = None
        policy_from = through if survival.lockstep(config) else 0
    else:
        made = config.run_dir or (str(new_run_dir(config.out_dir)) if world.is_main else None)
        out = Path(popmesh.broadcast_object(made if world.is_main else None, src=0))
        start, resumed = _resume(world, config, learner, policy)
        through = policy_from = 0
    if trace.ACTIVE is None:  # every rank's timeline, merged into out/trace.json at finalize (docs/observe.md)
        world.start_trace(out)
    checkpoints = Checkpointer(out / "checkpoints", config.checkpoint_every, keep=config.checkpoint_keep,
                               group=world)
    checkpoints.skip_through(through)
    reporter.board = Board(out / "tb", group=world)  # one TensorBoard run per rank: tensorboard --logdir runs
    if view is not None:
        view.start()
    timer = Timer()
    sharing = SampleSharing(world) if config.share_samples else None
    try:
        policy = _train(world, config, learner, policy, reporter, timer, out, start, checkpoints, policy_from,
                        sharing)
        if hasattr(policy, "shutdown"):
            policy.shutdown()
        reporter.finish()  # before the view's last frame, so it shows every rank's final numbers
    finally:
        if sharing is not None:
            sharing.close()
        reporter.board.close()
        if view is not None:
            view.stop()
    summary = _finish(world, config, learner, reporter, timer, out, resumed, checkpoints)
    learner.close()
    world.finalize()
    return summary


def _agent(config: DemoConfig, agent: int) -> PPOLearner:
    """Agent ``agent``'s learner (its launcher number): seeds and starting hyper-parameters of its own."""
    hyper = rank_hyper(config.seed, agent, config.lr_range, config.ent_range)
    return PPOLearner(rank_seed(config.seed, agent), hyper, init_seed=config.seed, env=config.env)


def _resume(world: Any, config: DemoConfig, learner: PPOLearner,
            policy: Any) -> tuple[int, dict[str, Any] | None]:
    """With ``--resume``, or in an MPI job that the launcher restarted whole (from the run's own folder):
    every rank takes its agent (and its policy's state) back from the newest complete checkpoint; a rank
    that was lost when the survivors wrote it is seeded from them instead, as at a rejoin. The iteration
    to go on from, and where it came from with the ranks seeded (None when nothing was resumed)."""
    job_restarted = config.engine == "mpi" and world.restart_count > 0
    if not config.resume and not job_restarted:
        return 0, None
    root = Path(config.resume or config.run_dir)
    found = latest_checkpoint(root / "checkpoints" if (root / "checkpoints").is_dir() else root)
    if found is None and job_restarted:
        if world.is_main:
            print("the job restarted before its first checkpoint: training starts over", flush=True)
        return 0, None
    if found is None:
        raise ConfigError(f"--resume {config.resume}: no complete checkpoint there (a run folder written with "
                          "--checkpoint-every, or one of its checkpoints)")
    holes = missing_ranks(found)
    iteration = 0
    if world.rank not in holes:
        agent = load_agent(found, world.rank, world.size)
        iteration = learner.restore(agent)
        if policy is not None and "policy" in agent.extra and hasattr(policy, "load_state_dict"):
            policy.load_state_dict(agent.extra["policy"])
    seeded = []
    if holes:  # lost while the survivors wrote it: PBT's exploit from them, as at a rejoin
        seeding, iteration = exploit(world, config, learner, iteration, holes)
        assert seeding is not None  # holes are ranks of this world (load_agent checked its size)
        seeded = [{"rank": r, "donors": list(seeding.donors)} for r in holes]
    if world.is_main:
        print(f"resumed from {found} (iteration {iteration}, {learner.total_steps:,} steps per agent)", flush=True)
        for hole in seeded:
            print(f"rank {hole['rank']} was lost when that checkpoint was written: seeded from ranks "
                  f"{hole['donors']}", flush=True)
    return iteration, {"path": str(found), "seeded": seeded}


def _train(world: Any, config: DemoConfig, learner: PPOLearner, policy: Any, reporter: Reporter,
           timer: Timer, out: Path, start: int, checkpoints: Checkpointer, policy_from: int = 0,
           sharing: SampleSharing | None = None) -> Any:
    """The training loop; returns the policy in use at the end (a new one after the world re-formed). With
    ``sharing`` each agent also learns from the others' latest rollouts.

    The iteration count follows the env steps (``steps // per_iteration``, as every checkpoint and
    hand-over keeps them): an iteration whose training was done counts even when its population
    step failed on a lost rank, so every rank meets every checkpoint at the same count. After a loss
    the survivors go on as a population of their own (``world.survivors()``: their policy's decisions
    skip the lost rank; their checkpoints name it missing) and take the whole population back once the lost rank's
    restarted process is there (``world.newcomer_waiting()``): nobody waits for it. Ranks that meet
    again (in the survivors' group, or the world re-formed) may stand at different iterations; a
    synchronous policy, whose decisions every rank makes at the same iteration, is left out on each
    until all reach the furthest one (``policy_from``) and catch up.

    In an elastic world (``--nnodes MIN:MAX``) each rank also checks once per iteration whether a later
    launcher's ranks wait to join (``world.newcomer_waiting()``, a few store reads): ranks are at different
    iterations, so each re-forms where it notices (:func:`popmesh.demo.survival.reform`), not at one
    collective step. A rank lost with no restart left leaves for good: the others re-form without it,
    renumbered."""
    iteration, started, first_steps = start, time.monotonic(), learner.total_steps
    per_iteration = learner.hyper.rollout * learner.hyper.num_envs
    kill = config.kill_at()
    lost: survival.Lost | None = None  # set while this rank trains on alone, the world short of a lost rank
    reform = False  # the next generation must form now (a PeerFailure that an elastic world goes on from)
    while learner.total_steps < config.steps and not reporter.should_stop():
        if kill_due(kill, agent_of(world.roster, world.rank), iteration, world.restart_count):
            os.kill(os.getpid(), signal.SIGKILL)  # --kill: the demonstration's lost rank
        try:
            # the heartbeat's finding, if any (none looked for when the next generation forms anyway)
            failed = None if reform else world.failure(None if lost is None else lost.members)
            if failed is not None:
                raise failed
            if reform or ((lost is not None or config.elastic) and world.newcomer_waiting()):
                with timer.section("re-forming"):  # a process waits to join (restarted, or a later launcher's)
                    policy, policy_from = survival.reform(world, config, learner, reporter, iteration, out, checkpoints,
                                                  lost, policy)
                lost, reform = None, False
            current, since = (lost.policy, lost.policy_from) if lost else (policy, policy_from)
            acting = current if iteration >= since else None
            _iterate(world, config, learner, acting, reporter, timer, iteration, started, first_steps,
                     lost.group if lost else None, sharing)
            iteration = learner.total_steps // per_iteration
            if lost is not None:
                lost.iterations += 1
            if checkpoints.due(iteration) and (lost is None or lost.group is not None):
                _checkpoint(learner, policy, checkpoints, timer, iteration, lost)
                if lost is None:
                    reporter.agree_at_checkpoint()
        except PeerFailure as e:
            iteration = learner.total_steps // per_iteration
            reform = lost is None and goes_on(world, config, e)
            if not reform:
                lost = survival.leave(world, config, learner, policy, reporter, e, timer, iteration, lost, checkpoints)
    while True:  # the run ends whole: every rank, a restarted or joined one too, meets here in one generation
        try:
            if lost is not None or reform:  # this rank's steps ran out while the world was short, or changing
                with timer.section("re-forming"):
                    policy = survival.reform(world, config, learner, reporter, iteration, out, checkpoints, lost,
                                             policy)[0]
                lost, reform = None, False
            if not config.elastic:
                popmesh.barrier(group=world)
                return policy
            reform = anyone_waiting(world)  # a later launcher's ranks that came as the others finished join too
            if not reform:
                return policy
        except PeerFailure as e:  # a loss this rank had not seen before its last iteration
            reform = lost is None and goes_on(world, config, e)
            if not reform:
                lost = survival.leave(world, config, learner, policy, reporter, e, timer, iteration, lost, checkpoints)


def _checkpoint(learner: PPOLearner, policy: Any, checkpoints: Checkpointer, timer: Timer, iteration: int,
                lost: survival.Lost | None) -> None:
    """Every rank of the population, or of the survivors' group while a rank is lost (the checkpoint then
    names it missing, and a run resumed from it seeds it from the others). The policy's state is the
    whole population's (kept from before the loss), not the survivors' policy's."""
    with timer.section("checkpoint"):
        if lost is None:
            state = policy.state_dict() if hasattr(policy, "state_dict") else {}
        else:
            state = lost.policy_state or {}
        checkpoints.save(iteration, learner.checkpoint(iteration, {"policy": state}),
                         group=None if lost is None else lost.group)


def _iterate(world: Any, config: DemoConfig, learner: PPOLearner, policy: Any, reporter: Reporter,
             timer: Timer, iteration: int, started: float, first_steps: int, group: Any = None,
             sharing: SampleSharing | None = None) -> None:
    """One iteration: train (on the others' rollouts too, with ``sharing``), let the population policy act
    (over ``group``; None: the world), report."""
    learner.iterate(timer, share=None if sharing is None else lambda rollout: sharing.exchange(rollout, iteration))
    metric = learner.mean_return()
    event = None
    if policy is not None and iteration >= config.warmup:
        loop = {"hparams": {k: v for k, v in learner.explored().items() if k in config.explore and k != "lr"}} \
            if config.library_explores else {}  # the learning rate is read from the optimizer
        with timer.section("population"):
            learner.model, optimizer, info = policy(iteration - config.warmup, learner.model,
                                                    learner.optimizer, learner.score(config.select_last), group=group,
                                                    **loop)
        learner.optimizer = optimizer if optimizer is not None else learner.optimizer
        if info.replaced:
            learner.adopt_returns()
            explored = _assigned(learner, info) if info.hparams and config.library_explores else \
                explore_agent(config, learner, agent_of(world.roster, world.rank), iteration)
            event = {**_event(world, learner, info, metric, config.warmup), **explored}
    row = {"rank": agent_of(world.roster, world.rank), "world_size": world.size, "iteration": iteration,
           "steps": learner.total_steps,
           "mean_return": None if math.isnan(metric) else metric, "time": time.time(),
           "steps_per_s": (learner.total_steps - first_steps) / max(time.monotonic() - started, 1e-9),
           "lr": learner.optimizer.param_groups[0]["lr"], "ent_coef": learner.hyper.entropy}
    reporter.record(row, event)


def _assigned(learner: PPOLearner, info: Any) -> dict[str, Any]:
    """A replaced agent trains at the values the population policy assigned (its best donor's, explored);
    what the event keeps, as :func:`explore_agent` keeps it."""
    inherited = {**learner.explored(), **info.inherited}
    learner.adopt_hyper()  # the weights' buffers first, for any name not explored
    learner.set_hyper(**info.hparams_now)
    now = learner.explored()
    return {**{f"{name}_inherited": value for name, value in inherited.items()}, **now,
            "explored": [name for name in now if not math.isclose(now[name], inherited[name], rel_tol=1e-6)]}


def _event(world: Any, learner: PPOLearner, info: Any, metric: float, warmup: int) -> dict[str, Any]:
    """A replacement as events.jsonl keeps it, in the demo's iterations: ``decided_at`` is the iteration
    whose metrics decided it (warm-up plus a multiple of --every), ``iteration`` the one at which this
    rank applied it (later for the asynchronous policy: the decision travels while the agents train).
    The agent and its donors are named by their launcher numbers (``world.roster``)."""
    decided = info.iteration if info.decision_iteration is None else info.decision_iteration
    return {"time": time.time(), "rank": agent_of(world.roster, world.rank), "iteration": info.iteration + warmup,
            "decided_at": decided + warmup, "steps": learner.total_steps,
            "donors": agents_of(world.roster, info.donors), "weights": list(info.weights),
            "strategy": info.strategy or "mean",
            "metric_before": None if math.isnan(metric) else metric, "optimizer": info.optimizer,
            "summary": info.summary}


def _finish(world: Any, config: DemoConfig, learner: PPOLearner, reporter: Reporter,
            timer: Timer, out: Path, resumed: dict[str, Any] | None = None,
            checkpoints: Checkpointer | None = None) -> dict[str, Any] | None:
    finals = popmesh.gather_object({"rank": agent_of(world.roster, world.rank), "steps": learner.total_steps,
                                    "mean_return": None if math.isnan(learner.mean_return()) else learner.mean_return(),
                                    **learner.explored(), "shared_rollouts": learner.shared_rollouts,
                                    "rows": reporter.own}, dst=0)
    times = report_timings(timer, group=world, show=False)
    imbalance = report_imbalance(timer, group=world, show=False)
    if not world.is_main:
        return None
    reporter.complete_history([agent.pop("rows") for agent in finals])
    survival = [e for e in reporter.events if "kind" in e]
    summary = {"config": config.to_dict(), "env": config.env, "target": config.target, "agents": finals,
               "reached_target": reporter.reached,
               "replacements": len(reporter.events) - len(survival),
               "explored": sum(bool(e.get("explored")) for e in reporter.events), "engine": world.engine_name,
               "ranks": world.size, "resumed_from": None if resumed is None else resumed["path"],
               "generation": world.generation, "restarts": [e for e in survival if e["kind"] == "rejoined"],
               "job_restarts": world.restart_count if config.engine == "mpi" else 0,
               "world_size": world.size, "world_sizes": reporter.sizes,
               "joined": [e for e in survival if e["kind"] == "joined"],
               "left": [e for e in survival if e["kind"] == "left"]}
    if resumed is not None and resumed["seeded"]:  # lost when the survivors wrote the checkpoint
        summary["resumed_seeded"] = resumed["seeded"]
    if checkpoints is not None and checkpoints.every:
        summary["checkpoints"] = {"written": checkpoints.saved, "seconds": round(checkpoints.seconds_spent, 3),
                                  "every": checkpoints.every, "folder": str(out / "checkpoints")}
    write_jsonl(out / "events.jsonl", reporter.events)
    write_jsonl(out / "history.jsonl", reporter.history)
    write_summary(out / "summary.json", summary)
    baseline = read_history(config.baseline) if config.baseline else []
    plot_returns(out / "returns.png", reporter.history, reporter.events, config.target, baseline,
                 f"{Path(config.baseline).name} (--baseline)", env=config.env)
    print_summary(summary, times, imbalance, out)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of popmesh's demo")
    parser.add_argument("--config", required=True, help="DemoConfig as JSON")
    ns = parser.parse_args(argv)
    run(DemoConfig(**json.loads(ns.config)))


if __name__ == "__main__":
    main()
