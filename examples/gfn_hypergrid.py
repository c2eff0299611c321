# run: popmesh launch -n 6 examples/gfn_hypergrid.py   (4 trainers, a replay-buffer manager, the coordinator)
"""A population of GFlowNets on torchgfn's hypergrid, trained on several ranks with popmesh.

Every trainer rank trains a trajectory-balance GFlowNet (torchgfn's ``TBGFlowNet``) from the same
initial weights, at its own learning rate drawn log-uniformly from ``--lr-range`` (seeded per seed and
rank: some agents learn, some crawl, some collapse); the agent, one per trainer, is
``hypergrid_agent.Agent`` beside this script. popmesh gives the run:

* roles (``popmesh.assign_roles``): the trainers, ``--buffers`` replay-buffer managers that score the
  terminal states their trainers send and report the modes among them, and the coordinator (the last
  rank), which counts the distinct modes found across managers; with ``--buffers 0`` every rank trains,
  without the service (it only counts modes: the agents train on fresh trajectories either way);
* a population policy over the trainers (``--policy``): ``selective`` is ``AsyncSelectiveAveraging``
  deciding on each member's latest report (``--decide complete``: once every trainer reported the
  iteration), ranking agents by their negative L1 distance to the target distribution (``objective=``;
  the training metric stays -loss) and exploring the replaced agent's learning rate; ``average`` is
  ``AverageAll``; ``torchgfn`` is torchgfn's own one-sided MPI policy through
  ``popmesh.compat.spawn_policy`` (``popmesh launch --engine mpi``); ``none`` trains alone;
* shared experience (``--share-trajectories``): each trainer sends its trajectories to the other trainers
  every iteration (``popmesh.population.SampleSharing``, never waited for) and trains on theirs with its
  own, in one trajectory-balance step: the loss holds for any sampler, so their log-probabilities are
  only recomputed under its own policies;
* survival: ``--kill-rank R --kill-at I`` makes trainer R's first process SIGKILL itself at iteration I.
  Under ``popmesh launch --max-restarts 1`` the other trainers train on alone (``world.try_reform()``),
  the managers and the coordinator re-form by themselves, and the restarted process rejoins, seeded
  from the best agents (``seed_newcomers``); ``--policy average`` then waits until every trainer has
  reached the furthest one's iteration, since its averages are collectives at fixed iterations;
* the trace timeline (``trace.json``, open it in https://ui.perfetto.dev) and one TensorBoard run per
  trainer (``tensorboard --logdir OUT/tb``): exact L1, modes found, loss, logZ, learning rate.

Every ``--validate-every`` iterations a trainer computes, by dynamic programming over the grid, the exact
distribution of the terminal states its forward policy samples, and its L1 distance to the target
(reward / Z). Files under ``--out``: history.jsonl (a row per trainer and validation), events.jsonl
(replacements, losses, rejoins), summary.json, tb/, trace.json, manager-R.json, coordinator.json.

    popmesh launch -n 6 examples/gfn_hypergrid.py --ndim 2 --height 16 --r0 0.01 --iterations 1000
    popmesh launch -n 6 --max-restarts 1 examples/gfn_hypergrid.py --kill-rank 1 --kill-at 300
    popmesh launch -n 6 --engine mpi examples/gfn_hypergrid.py --policy torchgfn
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypergrid_agent import Agent, Grid, make_gflownet, start_lr, trajectory_arrays

import popmesh
from popmesh.buffers import Coordinator, ReplayBufferClient, ReplayBufferManager
from popmesh.core import trace
from popmesh.observe.reports import Timer
from popmesh.population import (
    AsyncSelectiveAveraging,
    AverageAll,
    Continuous,
    DonorRule,
    EventLog,
    Explore,
    ReplacementRule,
    SampleSharing,
)
from popmesh.population.state.rejoin import seed_newcomers

POLICIES = ("selective", "average", "none", "torchgfn")
MAX_STATES = 1_000_000  # the exact L1 enumerates every state of the grid


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="a population of hypergrid GFlowNets (run it under popmesh launch)")
    p.add_argument("--ndim", type=int, default=2, help="dimensions of the grid (default 2)")
    p.add_argument("--height", type=int, default=16, help="cells per dimension (default 16)")
    p.add_argument("--r0", "--R0", type=float, default=0.01, help="reward far from the modes (default 0.01)")
    p.add_argument("--iterations", type=int, default=1000, help="training iterations per trainer (default 1000)")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories per trainer and iteration (default 16)")
    p.add_argument("--hidden", type=int, default=64, help="width of the two hidden layers (default 64)")
    p.add_argument("--lr-range", default="1e-5:0.1", metavar="LOW:HIGH",
                   help="each trainer's learning rate, log-uniform (default 1e-5:0.1); explored within it")
    p.add_argument("--lr-z", type=float, default=0.1, help="logZ's learning rate, every trainer (default 0.1)")
    p.add_argument("--policy", choices=POLICIES, default="selective", help="population policy (default selective)")
    p.add_argument("--every", type=int, default=25, help="iterations between population decisions (default 25)")
    p.add_argument("--decide", choices=("latest", "complete"), default="latest",
                   help="--policy selective: judge each report against the others' latest (default), or decide once "
                        "every trainer reported the iteration")
    p.add_argument("--validate-every", type=int, default=25, help="iterations between validations (default 25)")
    p.add_argument("--buffers", type=int, default=1,
                   help="replay-buffer manager ranks (default 1); 0: every rank trains, no service and no coordinator")
    p.add_argument("--send-every", type=int, default=4, help="iterations between batches to the manager (default 4)")
    p.add_argument("--share-trajectories", action="store_true",
                   help="each trainer sends its trajectories to the other trainers every iteration and trains on "
                        "theirs too, in one step (popmesh.population.SampleSharing; never waited for)")
    p.add_argument("--seed", type=int, default=0, help="seed: initial weights, learning rates, sampling")
    p.add_argument("--out", default="runs/gfn-hypergrid", help="output folder (default runs/gfn-hypergrid)")
    p.add_argument("--kill-rank", type=int, default=None, help="this trainer's first process dies at --kill-at")
    p.add_argument("--kill-at", type=int, default=None, help="the iteration at which --kill-rank dies")
    ns = p.parse_args(argv)
    text = ns.lr_range
    try:
        ns.lr_range = tuple(float(x) for x in text.split(":"))
        Continuous(*ns.lr_range, log=True)
    except (TypeError, ValueError, popmesh.ConfigError):
        p.error(f"--lr-range {text}: give LOW:HIGH with 0 < LOW < HIGH, e.g. 1e-4:1e-2")
    small = {"--ndim": ns.ndim, "--iterations": ns.iterations, "--batch-size": ns.batch_size, "--every": ns.every,
             "--validate-every": ns.validate_every, "--send-every": ns.send_every}
    for option, value in small.items():
        if value < 1:
            p.error(f"{option} {value}: give 1 or more")
    if ns.buffers < 0:
        p.error(f"--buffers {ns.buffers}: give 0 or more")
    if ns.height < 2 or ns.height ** ns.ndim > MAX_STATES:
        p.error(f"--ndim {ns.ndim} --height {ns.height}: the exact L1 enumerates height**ndim states, at most "
                f"{MAX_STATES:,}: choose a smaller grid (height 2 or more)")
    if (ns.kill_rank is None) != (ns.kill_at is None):
        p.error("give --kill-rank and --kill-at together")
    return ns


def mode_score(grid: Grid) -> Any:
    """A manager's scoring function: the modes among a batch's terminal cells that this manager had not
    seen (reported to the coordinator, which counts the distinct ones across managers)."""
    seen: set[int] = set()

    def score(batch: dict[str, Any], store: Any) -> dict[str, Any]:
        new = grid.modes_in(batch["states"]) - seen
        seen.update(new)
        return {"score": float(len(new)), "modes": [str(m) for m in sorted(new)]}

    return score


def serve(ctx: Any, grid: Grid, out: Path) -> None:
    """A manager or the coordinator: serve until every trainer has left, then write what was seen."""
    if ctx.is_buffer_rank():
        stats = ReplayBufferManager.from_context(ctx, scoring_function=mode_score(grid), report_every=20).run()
        (out / f"manager-{ctx.my_rank}.json").write_text(json.dumps(stats.to_dict(), indent=1))
    else:
        found = Coordinator.from_context(ctx).run()
        (out / "coordinator.json").write_text(json.dumps({**found, "modes": len(grid.modes)}, indent=1))


class Trainer:
    """One trainer rank: its agent, its buffer client, its share of the population policy, its logs."""

    def __init__(self, ns: argparse.Namespace, world: Any, ctx: Any, grid: Grid, out: Path) -> None:
        self.ns, self.world, self.ctx, self.grid, self.out = ns, world, ctx, grid, out
        self.rank, self.timer = world.rank, Timer()
        self.lr_start = start_lr(ns.lr_range, ns.seed, self.rank)
        self.agent = Agent(grid, seed=ns.seed, rank=self.rank, lr=self.lr_start, hidden=ns.hidden, lr_z=ns.lr_z,
                           batch_size=ns.batch_size, generation=world.generation)
        self.gflownet = self.agent.gflownet  # the policies replace its weights in place; the optimizer they return
        self.client = (ReplayBufferClient.from_context(ctx, mode="async-comm", remote_every=ns.send_every)
                       if ns.buffers else None)  # --buffers 0: no service, the population's modes counted at the end
        self.board = popmesh.Board(out / "tb")  # one TensorBoard run per trainer: tb/rank-R
        self.events, self.history = (EventLog(out / f"{name}.jsonl", self.rank) for name in ("events", "history"))
        self.first_life = world.restart_count == 0  # not a restarted process
        self.iteration, self.replaced, self.lost = 0, 0, False
        self.policy_from = 0  # after a rejoin, a lockstep policy acts from here on (every trainer caught up)
        self.found_at: dict[int, int] = {}  # mode -> iteration at which this rank first sampled it
        self.l1, self.best_l1 = math.nan, math.inf
        self.losses: list[float] = []  # since the last validation
        self.shared = 0  # other trainers' batches trained on (--share-trajectories)
        if self.rank in world.newcomers:  # restarted for a lost trainer: the population seeds it
            self.seed()
        self.policy, self.sharing = self.make_policy(), self.make_sharing()

    def make_policy(self) -> Any:
        """The population policy named by --policy (None for none); channel 0 on every trainer, so that
        a policy made again after a re-form meets the restarted process's."""
        ns = self.ns
        if ns.policy == "selective":
            return AsyncSelectiveAveraging(ns.every, decide=ns.decide, channel=0, rule=ReplacementRule(ratio=0.25),
                                           donor_rule=DonorRule(kind="best_k", k=2), seed=ns.seed,
                                           explore=Explore(keys=("lr",), space={"lr": Continuous(*ns.lr_range,
                                                                                                 log=True)},
                                                           param_groups=(0,)))  # the policy's; logZ keeps its own
        if ns.policy == "average":
            return AverageAll(ns.every)
        if ns.policy == "torchgfn":
            from popmesh.compat.spawn_policy import AsyncSelectiveAveragingPolicympi4pyGeneral

            return AsyncSelectiveAveragingPolicympi4pyGeneral(
                lambda: make_gflownet(self.grid, ns.hidden, ns.seed), self.gflownet, ns.every, replacement_ratio=0.25,
                averaging_strategy="mean", momentum=0.0, replacement_mode="worst_ratio",
                group=self.ctx.train_global_group)
        return None

    def make_sharing(self) -> SampleSharing | None:
        """--share-trajectories: the trainers' sample sharing (made again with their group after a re-form)."""
        return SampleSharing(self.ctx.train_global_group) if self.ns.share_trajectories else None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.agent.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.agent.optimizer = optimizer

    @property
    def lr(self) -> float:
        return self.agent.lr

    def run(self) -> None:
        """Train --iterations; a lost peer is a hole the others train around (see the module docstring)."""
        ns = self.ns
        while self.iteration < ns.iterations:
            it = self.iteration
            if (ns.kill_rank, ns.kill_at) == (self.rank, it) and self.first_life:
                os.kill(os.getpid(), signal.SIGKILL)  # the demonstration's lost trainer
            if self.lost:
                self.try_rejoin()
            cells, log_rewards = self.train(it)
            validating = it % ns.validate_every == 0 or it == ns.iterations - 1
            if validating or it % ns.every == 0:
                with self.timer.section("validate"):
                    self.l1 = self.agent.l1()
                self.best_l1 = min(self.best_l1, self.l1)
            population = None
            if not self.lost:
                try:
                    failed = self.world.failure()  # the heartbeat's news of a lost rank, if any
                    if failed is not None:
                        raise failed
                    with self.timer.section("population"):
                        self.population_step(it, cells, log_rewards)
                        population = self.population_modes() if validating else None
                except popmesh.PeerFailure as e:
                    self.leave(e, it)
            if validating:
                self.log(it, population)
            self.iteration += 1
        while self.lost:  # the run ends in one generation: wait for the restarted process
            time.sleep(0.05)
            self.try_rejoin()
        self.finish()

    def population_modes(self) -> int | None:
        """The distinct modes the service has seen across trainers (None without a service)."""
        return None if self.client is None else self.client.population_stats()["modes_found"]

    def train(self, it: int) -> tuple[np.ndarray, np.ndarray]:
        """One trajectory-balance step on fresh trajectories; the terminal cells and their log-rewards."""
        with self.timer.section("sample"):
            trajectories = self.agent.sample()
        shared: list[Any] = []
        if self.sharing is not None and not self.lost:  # alone after a loss, until the world re-forms
            with self.timer.section("share"):
                shared = self.sharing.exchange(trajectory_arrays(trajectories), it)
            self.shared += len(shared)
        with self.timer.section("train"):
            self.losses.append(self.agent.learn(trajectories, shared))
        final = trajectories.terminating_states
        for mode in self.grid.env.modes_found(final):
            self.found_at.setdefault(mode, it)
        return final.tensor.numpy().copy(), trajectories.log_rewards.detach().numpy().copy()

    def population_step(self, it: int, cells: np.ndarray, log_rewards: np.ndarray) -> None:
        """The replay-buffer service gets the terminal cells; the population policy acts."""
        if self.client is not None:
            self.client.add({"states": cells, "log_rewards": log_rewards})
        if self.policy is None or it < self.policy_from:
            return
        group, lr = self.ctx.train_global_group, self.lr
        objective = -self.l1 if it % self.ns.every == 0 else None  # what selection ranks by, on decision points
        if self.ns.policy == "torchgfn":  # its metric is what it ranks by; it is read on decision points only
            _, self.optimizer, out = self.policy(it, self.gflownet, self.optimizer, objective, group=group)
            info = out["policy_info"]
        elif self.ns.policy == "average" or self.ns.decide == "complete":  # the metric is what selection ranks by
            _, self.optimizer, info = self.policy(it, self.gflownet, self.optimizer, objective, group=group)
        else:  # decide latest: the training metric (-loss) apart from what selection ranks by
            _, self.optimizer, info = self.policy(it, self.gflownet, self.optimizer, -self.losses[-1], group=group,
                                                  objective=objective)
        if info.replaced:
            self.replaced += 1
            self.events.write({"event": "replace", "policy": self.ns.policy, "rank": self.rank, "iteration": it,
                               "decided_at": info.decision_iteration, "donors": list(info.donors),
                               "lr": [lr, self.lr], "l1_before": self.l1})

    def log(self, it: int, population: int | None) -> None:
        """A validation's row in history.jsonl, TensorBoard and one line on stdout."""
        loss = float(np.mean(self.losses)) if self.losses else math.nan
        self.losses = []
        row = {"rank": self.rank, "iteration": it, "l1": self.l1, "modes": len(self.found_at),
               "population_modes": population, "lr": self.lr, "loss": loss,
               "logZ": self.gflownet.logZ.item(), "replaced": self.replaced, "generation": self.world.generation}
        self.history.write(row)
        self.board.scalars({"l1/exact": self.l1, "modes/found": len(self.found_at), "modes/population": population,
                            "loss/tb": loss, "train/logZ": row["logZ"], "hparams/lr": self.lr,
                            "population/replaced": self.replaced}, step=it)
        total = len(self.grid.modes)
        seen = "" if population is None else f" (population {population}/{total})"
        print(f"iteration {it:>5}: L1 {self.l1:.3f}, modes {len(self.found_at)}/{total}{seen}, lr {self.lr:.1e}, "
              f"loss {loss:.3f}", flush=True)

    def leave(self, error: popmesh.PeerFailure, it: int) -> None:
        """A rank was lost: stop the policy (its traffic went with the broken world) and train on alone."""
        if not self.world.restarts_lost_ranks:
            raise error
        shut_down(self.policy)
        if self.sharing is not None:
            self.sharing.close()
        self.policy, self.sharing, self.lost = None, None, True
        self.events.write({"event": "lost", "ranks": list(error.ranks), "seen_by": self.rank, "iteration": it})
        self.try_rejoin()  # leaves the broken generation at once

    def try_rejoin(self) -> None:
        """Once the restarted process waits to join: the next generation, the roles' groups made again,
        the unanswered batch sent again, the newcomer seeded and a new policy."""
        if self.world.try_reform() is None:
            return
        self.ctx.rebuild()
        if self.client is not None:
            self.client.reconnect()
        self.seed()
        self.policy, self.sharing, self.lost = self.make_policy(), self.make_sharing(), False

    def seed(self) -> None:
        """Collective over the trainers after a re-form: a newcomer takes the mean of the best two agents'
        weights (ranked by -L1), the best one's optimizer state (its learning rate too) and iteration. The
        trainers then stand at different iterations (the survivors trained on alone, each at its pace), so
        a lockstep policy (``average``: a collective at the same iterations on every trainer) waits until
        each has reached the furthest one."""
        group = self.ctx.train_global_group
        seeding = seed_newcomers(self.gflownet, self.optimizer, -self.l1, {"iteration": self.iteration}, group=group)
        newcomer = seeding is not None and self.rank in seeding.newcomers
        if newcomer:
            self.iteration = int(seeding.counters["iteration"])
        if self.ns.policy == "average":
            self.policy_from = int(popmesh.all_reduce(np.array([self.iteration]), "max", group=group)[0])
        if newcomer:
            self.events.write({"event": "rejoined", "rank": self.rank, "iteration": self.iteration,
                               "donors": list(seeding.donors), "generation": self.world.generation,
                               "policy_from": self.policy_from})

    def finish(self) -> None:
        """Every trainer at the end: the policy wound down, the population's modes asked for, the client
        drained; the first trainer writes summary.json and prints the population."""
        while True:
            try:
                popmesh.barrier(group=self.ctx.train_global_group)  # a loss seen only now is met here
                break
            except popmesh.PeerFailure as e:
                self.leave(e, self.iteration)
                while self.lost:
                    time.sleep(0.05)
                    self.try_rejoin()
        group = self.ctx.train_global_group
        shut_down(self.policy)
        if self.sharing is not None:
            self.sharing.close()
        stats = self.client.population_stats() if self.client is not None else None
        if self.client is not None:
            self.client.drain()
        self.board.close()
        agent = {"rank": self.rank, "l1": self.l1, "best_l1": self.best_l1, "modes": len(self.found_at),
                 "mode_found_at": {str(m): i for m, i in sorted(self.found_at.items())}, "lr_start": self.lr_start,
                 "lr": self.lr, "replaced": self.replaced, "shared_batches": self.shared,
                 "generation": self.world.generation}
        agents = popmesh.gather_object(agent, dst=group.ranks[0], group=group)
        popmesh.report_timings(self.timer, group=group, dst=group.ranks[0])
        if agents is not None:
            summarise(self.ns, self.grid, agents, stats, self.world, self.out)


def shut_down(policy: Any) -> None:
    """End a policy's traffic; a failure it met is already known."""
    if hasattr(policy, "shutdown"):
        try:
            policy.shutdown()
        except popmesh.PopmeshError:
            pass


def all_modes_at(agents: list[dict[str, Any]], modes: set[int]) -> dict[str, int | None]:
    """The first iteration at which one agent had sampled every mode, and the population had (each mode by
    some agent); None where that never happened."""
    by_agent = [max(a["mode_found_at"].values()) for a in agents if len(a["mode_found_at"]) == len(modes)]
    firsts = [min((a["mode_found_at"][str(m)] for a in agents if str(m) in a["mode_found_at"]), default=None)
              for m in modes]
    return {"any_agent": min(by_agent, default=None),
            "population": None if None in firsts else max(i for i in firsts if i is not None)}


def summarise(ns: argparse.Namespace, grid: Grid, agents: list[dict[str, Any]], stats: dict[str, Any] | None,
              world: Any, out: Path) -> None:
    """summary.json and the population's last state, printed; without a service (``stats`` None) the
    population's modes are those the agents sampled."""
    counted = "the coordinator's count" if stats is not None else "the agents' own samples"
    if stats is None:
        stats = {"modes_found": len({m for a in agents for m in a["mode_found_at"]}),
                 "modes_by_rank": {str(a["rank"]): a["modes"] for a in agents}}
    summary = {"config": vars(ns), "engine": world.engine_name, "ranks": world.size, "modes": len(grid.modes),
               "agents": agents, "population_modes": stats["modes_found"], "modes_by_rank": stats["modes_by_rank"],
               "all_modes_at": all_modes_at(agents, grid.modes), "generation": world.generation}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{ns.ndim}-D hypergrid, height {ns.height}, R0 {ns.r0:g}; --policy {ns.policy}; {len(agents)} trainers:")
    for a in agents:
        print(f"  rank {a['rank']}: L1 {a['l1']:.3f} (best {a['best_l1']:.3f}), modes {a['modes']}/{len(grid.modes)}, "
              f"lr {a['lr_start']:.1e} -> {a['lr']:.1e}, replaced {a['replaced']}x")
    at = summary["all_modes_at"]
    print(f"modes found by the population: {stats['modes_found']}/{len(grid.modes)} ({counted}); "
          f"every mode by one agent at iteration {at['any_agent']}, by the population at {at['population']}")
    print(f"wrote {out}/summary.json, history.jsonl, events.jsonl, tb/ (tensorboard --logdir), trace.json "
          "(https://ui.perfetto.dev)", flush=True)


def check(ns: argparse.Namespace, world: Any, ctx: Any) -> None:
    """What the world must be for these options; ConfigError saying how to launch otherwise."""
    if ns.kill_rank is not None:
        if ns.kill_rank not in ctx.training_ranks:
            raise popmesh.ConfigError(f"--kill-rank {ns.kill_rank}: give a trainer's rank, one of {ctx.training_ranks}")
        if not world.restarts_lost_ranks:
            raise popmesh.ConfigError("--kill-rank needs a launcher that restarts the lost rank: popmesh launch "
                                      "--max-restarts 1 (torch engine)")
        if ns.policy == "torchgfn":
            raise popmesh.ConfigError("--kill-rank with --policy torchgfn: on MPI a lost rank ends the whole job; "
                                      "use --policy selective, average or none")
    if ns.policy == "torchgfn" and world.engine_name != "mpi":
        raise popmesh.ConfigError("--policy torchgfn runs torchgfn's one-sided MPI policy: launch with popmesh "
                                  "launch --engine mpi")


def main(argv: list[str] | None = None) -> None:
    ns = parse(argv)
    world = popmesh.init()
    torch.set_num_threads(1)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if trace.ACTIVE is None:  # every rank's timeline, merged into out/trace.json at finalize
        world.start_trace(out)
    served = ns.buffers > 0  # a service: its managers and the coordinator
    if world.size < ns.buffers + 1 + served:
        raise popmesh.ConfigError(f"{world.size} ranks: need a trainer, --buffers {ns.buffers} manager(s) and the "
                                  f"coordinator: popmesh launch -n {ns.buffers + 2} or more")
    ctx = popmesh.assign_roles(world, num_buffers=ns.buffers, use_coordinator=served)
    check(ns, world, ctx)
    grid = Grid(ns.ndim, ns.height, ns.r0)
    if ctx.is_training_rank():
        Trainer(ns, world, ctx, grid, out).run()
    else:
        serve(ctx, grid, out)
    world.finalize()


if __name__ == "__main__":
    main()
