"""``popmesh demo``: population RL on CartPole or Acrobot over a real world, one command; ``--task hypergrid``:
a population of GFlowNets on torchgfn's hypergrid (examples/gfn_hypergrid.py).

Registered with the CLI through the ``popmesh.commands`` entry point (see pyproject.toml).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from popmesh.core.errors import ConfigError
from popmesh.demo import hypergrid
from popmesh.demo.config import (
    ENVS,
    EXPLORABLE,
    OPTIMIZER_STATES,
    POLICIES,
    STRATEGIES,
    TASKS,
    DemoConfig,
    parse_explore,
    parse_range,
)
from popmesh.demo.outputs import new_run_dir
from popmesh.launch.cli import Command
from popmesh.launch.options import parse_endpoint, parse_nnodes

__all__ = ["COMMAND", "configure", "failure_note", "run_command", "run_hypergrid", "shared_cores_note"]


def configure(p: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    p.add_argument("--task", choices=TASKS, default=defaults.task,
                   help="cartpole (default): PPO agents on --env; hypergrid: GFlowNets on torchgfn's hypergrid with a "
                        "replay-buffer service (examples/gfn_hypergrid.py; its own options after --)")
    p.add_argument("--ranks", type=int, default=None,
                   help=f"agents, one per rank (default {defaults.ranks}; --task hypergrid: {hypergrid.RANKS} ranks, "
                        f"of which {hypergrid.RANKS - 2} trainers, a replay-buffer manager and the coordinator)")
    p.add_argument("--engine", choices=("torch", "mpi"), default=defaults.engine, help="engine (default torch/gloo)")
    p.add_argument("--policy", choices=POLICIES, default=defaults.policy, help="population policy (default async)")
    p.add_argument("--env", choices=tuple(ENVS), default=defaults.env,
                   help="the task: " + ", ".join(f"{env} (target {target:g})" for env, target in ENVS.items())
                        + f"; default {defaults.env}"),
    p.add_argument("--seed", type=int, default=defaults.seed, help="base seed; rank r uses seed*1000+r")
    p.add_argument("--steps", type=int, default=defaults.steps,
                   help=f"env steps per agent (default {defaults.steps:,})")
    p.add_argument("--every", type=int, default=defaults.every, help="iterations between population decisions")
    p.add_argument("--decide", choices=("latest", "complete"), default=defaults.decide,
                   help="--policy async: judge a rank as it reports against everyone's latest report (default), "
                        "or wait for every rank's report of one iteration")
    p.add_argument("--strategy", choices=STRATEGIES, default=defaults.strategy,
                   help="how donors combine into a replaced agent (default mean)")
    p.add_argument("--optimizer", choices=OPTIMIZER_STATES, default=defaults.optimizer,
                   help="what a replaced agent's Adam state starts from: reset (a fresh Adam, default), keep (its "
                        "own), copy (its best donor's, streamed with the weights)")
    p.add_argument("--donors", type=int, default=defaults.donors,
                   help=f"best agents that donate; several give the mean of their weights (default {defaults.donors})")
    p.add_argument("--ratio", type=float, default=defaults.ratio,
                   help=f"the bottom fraction of agents that may be replaced, in (0, 0.5] (default {defaults.ratio:g})")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="iterations before the first decision")
    p.add_argument("--select-last", type=int, default=defaults.select_last, metavar="K",
                   help="the population ranks agents by the mean return of their last K episodes (1 to 20; default: "
                        "the last 20, the metric and the target's)")
    p.add_argument("--share-samples", action="store_true",
                   help="each agent sends its rollout to the others each iteration and learns from theirs too "
                        "(behaviour-corrected PPO; --task hypergrid: the GFlowNets share their trajectories): fewer "
                        "env steps to the target")
    p.add_argument("--out", default=defaults.out_dir, help="where runs/<timestamp>/ goes (default ./runs)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop as soon as one agent's last 20 episodes average the task's target")
    p.add_argument("--no-live", action="store_true",
                   help="no live view (or, off a terminal, no progress lines): only the final summary")
    p.add_argument("--baseline", default="", metavar="RUN",
                   help="draw that earlier run's best agent beside this one in returns.png (e.g. a --policy none run)")
    p.add_argument("--explore", default=",".join(defaults.explore), metavar="NAMES",
                   help=f"what PBT's explore step moves on a replaced agent, comma-separated from "
                        f"{','.join(EXPLORABLE)} (default {','.join(defaults.explore)}): each inherited value is "
                        "multiplied by 0.8 or 1.2, or resampled from its range with probability 0.25")
    p.add_argument("--explore-method", choices=("perturb", "pb2"), default=defaults.explore_method,
                   help="perturb (default): Ray PBT's step above; pb2: PB2's Gaussian-process model of the "
                        "population's progress picks the values (--decide latest; needs scikit-learn)")
    p.add_argument("--reference", action="store_true",
                   help="rank 0 trains alone as a reference agent, never replaced or explored, to show what the "
                        "population bought (--decide latest, at least 3 ranks)")
    p.add_argument("--no-explore", action="store_true",
                   help="a replaced agent keeps the values it inherits (its donors', averaged on a log scale)")
    p.add_argument("--lr-range", default=_range_text(defaults.lr_range), metavar="LOW:HIGH",
                   help=f"each rank draws its learning rate log-uniformly from it, seeded per rank (default "
                        f"{_range_text(defaults.lr_range)}); explore stays within it")
    p.add_argument("--ent-range", default=_range_text(defaults.ent_range), metavar="LOW:HIGH",
                   help=f"the same for the entropy coefficient (default {_range_text(defaults.ent_range)})")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="checkpoint the whole population every K iterations into runs/<ts>/checkpoints")
    p.add_argument("--checkpoint-keep", type=int, default=2, metavar="N",
                   help="keep the newest N complete checkpoints (default 2)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart a lost rank up to N times; it rejoins, seeded by the best agents (--engine mpi: "
                        "the whole job restarts, resuming from the newest --checkpoint-every checkpoint)")
    p.add_argument("--kill", default="", metavar="RANK:ITERATION",
                   help="that rank kills itself once at that iteration (to watch --max-restarts at work, or a leave "
                        "with --nnodes MIN:MAX); RANK is the launcher's number for it")
    p.add_argument("--nnodes", type=parse_nnodes, default=None, metavar="MIN:MAX",
                   help="an elastic population (torch engine): node 0's launcher starts it, and each launcher started "
                        "later with --node-rank from MIN to MAX-1 adds its --ranks agents while it trains; a rank lost "
                        "with no restart left leaves it for good (one number N: a fixed world of N launchers)")
    p.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="this launcher's node, 0 to MAX-1 (default 0); its ranks are numbered K * --ranks + local rank")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="where every launcher of the run meets: node 0's host and a free port, the same for all")
    p.add_argument("--no-preload", action="store_true",
                   help="start every rank, and every restart, as a new interpreter instead of forking it from one "
                        "that imported torch (popmesh launch --preload): a restart then takes seconds")
    p.add_argument("--resume", default="", metavar="RUN",
                   help="resume from a run folder's newest complete checkpoint (or from one checkpoint)")
    p.add_argument("task_args", nargs="*", metavar="-- OPTIONS",
                   help="--task hypergrid: options for its script after --, e.g. -- --ndim 3 --height 8 --iterations "
                        "600")


def _range_text(pair: tuple[float, float]) -> str:
    """``1e-5:0.1`` as one would type it."""
    return ":".join(f"{x:g}".replace("e-0", "e-") for x in pair)


# The demo's ranks and restarts are forked from one process that imported these (docs/launcher.md).
_PRELOAD = ("torch", "numpy")


def shared_cores_note(ranks: int, cores: int, policy: str = "async") -> str:
    """What the demo says, once, when its agents outnumber the cores (4 agents on a 2-core laptop)."""
    waits = ("the population policy never waits for a rank that is descheduled" if policy in ("async", "none")
             else f"--policy {policy} waits for the slowest rank at each decision")
    return (f"popmesh demo: {ranks} agents on {cores} CPU core{'s' if cores != 1 else ''}, one rank each, take "
            f"turns on the cores. That is fine for this demo: each agent is a small network, and {waits}. The "
            f"run takes longer than on {ranks} cores; --ranks {max(cores, 1)} gives each rank a core.")


def run_command(ns: argparse.Namespace) -> int:
    from popmesh.launch.api import launch
    from popmesh.launch.plan import cpu_count

    if ns.no_explore and ns.explore != ",".join(DemoConfig().explore):
        print(f"popmesh demo: warning: --no-explore overrides --explore {ns.explore}: nothing is explored",
              file=sys.stderr)
    ranks = ns.ranks if ns.ranks is not None else hypergrid.RANKS if ns.task == "hypergrid" else DemoConfig().ranks
    nodes = _nodes(ns.nnodes)
    config = DemoConfig(task=ns.task, ranks=ranks, engine=ns.engine, policy=ns.policy, env=ns.env, seed=ns.seed,
                        steps=ns.steps, every=ns.every, strategy=ns.strategy, decide=ns.decide,
                        explore_method=ns.explore_method, reference=ns.reference, optimizer=ns.optimizer,
                        donors=ns.donors, ratio=ns.ratio, warmup=ns.warmup, select_last=ns.select_last,
                        share_samples=ns.share_samples,
                        out_dir=ns.out,
                        live=not ns.no_live, stop_at_target=ns.stop_at_target,
                        checkpoint_every=ns.checkpoint_every,
                        checkpoint_keep=ns.checkpoint_keep, resume=ns.resume, max_restarts=ns.max_restarts,
                        kill=ns.kill, explore=() if ns.no_explore else parse_explore(ns.explore),
                        lr_range=parse_range("--lr-range", ns.lr_range),
                        ent_range=parse_range("--ent-range", ns.ent_range),
                        terminal=sys.stdout.isatty(), baseline=ns.baseline, node_rank=ns.node_rank,
                        rdzv_endpoint=ns.rdzv_endpoint, nnodes=nodes[0], max_nodes=nodes[1])
    if config.task == "hypergrid":
        return run_hypergrid(config, ns.task_args, no_preload=ns.no_preload)
    if ns.task_args:
        raise ConfigError(f"{' '.join(ns.task_args)}: options after -- go to --task hypergrid's script; the CartPole "
                          "task takes none")
    # node 0's rank 0 holds the terminal; a later launcher's ranks report to it
    terminal = config.live and config.terminal and config.engine == "torch" and config.node_rank == 0
    if config.engine == "mpi" and config.max_restarts:  # every start of the job writes and resumes in one folder
        config = dataclasses.replace(config, run_dir=str(new_run_dir(config.out_dir)))
    addr, port = parse_endpoint(config.rdzv_endpoint) if config.rdzv_endpoint else ("127.0.0.1", 0)
    if config.elastic and config.node_rank >= config.nnodes:
        first = config.node_rank * config.ranks
        print(f"popmesh demo: this launcher's {config.ranks} rank(s) ({first} to {first + config.ranks - 1}) join the "
              f"population that meets at {config.rdzv_endpoint}; node 0's launcher shows the run and writes its files",
              file=sys.stderr)
    result = launch("popmesh.demo.worker", ["--config", json.dumps(config.to_dict())], module=True,
                    nproc=config.ranks, engine=config.engine, quiet_others=True, rank0_terminal=terminal,
                    max_restarts=config.max_restarts, nnodes=config.nnodes, max_nodes=config.max_nodes or None,
                    node_rank=config.node_rank, master_addr=addr, master_port=port,
                    preload=() if ns.no_preload or config.engine == "mpi" else _PRELOAD,
                    oversubscription_note=shared_cores_note(config.ranks, cpu_count(), config.policy))
    if result.returncode != 0:
        error = result.failure.error if result.failure is not None else None
        print(failure_note(result.returncode, config.elastic, error.type if error is not None else ""),
              file=sys.stderr)
    return result.returncode


def failure_note(code: int, elastic: bool, error_type: str = "") -> str:
    """What the demo says after its launcher ended with ``code`` (not 0); ``error_type``: the exception that
    the failed rank raised, where it left one."""
    if error_type.endswith("WorldTooSmall"):
        return (f"popmesh demo: the population fell below --nnodes MIN and stopped (exit {code}); see the summary "
                "above")
    went_on = "; in an elastic world the others go on without it" if elastic else ""
    return f"popmesh demo: a rank failed (exit {code}){went_on}; see the summary above"


def _nodes(nnodes: tuple[int, int | None] | None) -> tuple[int, int]:
    """``--nnodes`` (parsed: ``(N, None)`` or ``(MIN, MAX)``) as DemoConfig's ``nnodes`` and ``max_nodes`` (0: a
    world of fixed size)."""
    if nnodes is None:
        return 1, 0
    low, high = nnodes
    return low, high or 0


def run_hypergrid(config: DemoConfig, extra: list[str], no_preload: bool = False) -> int:
    """``--task hypergrid``: examples/gfn_hypergrid.py on ``config.ranks`` ranks, into runs/<timestamp>/."""
    from popmesh.launch.api import launch
    from popmesh.launch.plan import cpu_count

    script = hypergrid.script_path()
    out = new_run_dir(config.out_dir)
    args = hypergrid.script_args(config.policy, config.seed, config.lr_range, out, config.kill_at(), extra,
                                 share=config.share_samples)
    result = launch(str(script), args, nproc=config.ranks, engine=config.engine, quiet_others=True,
                    max_restarts=config.max_restarts,
                    preload=() if no_preload or config.engine == "mpi" else hypergrid.PRELOAD,
                    oversubscription_note=hypergrid.cores_note(config.ranks, cpu_count(), config.policy))
    if result.returncode != 0:
        print(f"popmesh demo: a rank failed (exit {result.returncode}); see the summary above", file=sys.stderr)
    return result.returncode


COMMAND = Command("demo", "population RL on CartPole or Acrobot (or GFlowNets on a hypergrid, --task hypergrid): one "
                          "agent per rank, weak agents replaced",
                  configure, run_command)
