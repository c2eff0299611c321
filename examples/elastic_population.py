# run: popmesh launch --nnodes 1:2 --node-rank 0 -n 2 --rdzv-endpoint 127.0.0.1:29560 examples/elastic_population.py
"""A population that grows and shrinks while it trains (docs/survival.md, "Growing and shrinking").

Start one launcher per node with the same ``--nnodes MIN:MAX`` and ``--rdzv-endpoint``; nodes 0 to MIN-1
form the world, and a launcher started later with ``--node-rank`` from MIN to MAX-1 joins it:

    popmesh launch --nnodes 1:2 --node-rank 0 -n 2 --rdzv-endpoint 127.0.0.1:29560 examples/elastic_population.py
    popmesh launch --nnodes 1:2 --node-rank 1 -n 2 --rdzv-endpoint 127.0.0.1:29560 examples/elastic_population.py

Each agent fits a small network to a noisy curve at its own learning rate, drawn log-uniform over 1e-4
to 1e-1. Every ``--every`` iterations the population decides together (SelectiveAveraging: the worst
quarter take the best agents' weights and a perturbed or resampled learning rate, PBT's exploit and
explore), and at that safe point ``world.admit()`` takes in the ranks of a launcher started later: they
are seeded from the best agents (``seed_newcomers``: the mean of the two best agents' weights, the best
one's Adam state and learning rate, its iteration), then explore from there (the learning rate
perturbed by 0.8 or 1.2, or drawn afresh with probability 0.25), so that they bring diversity of their
own. A rank lost with no restart left leaves for good: the others re-form without it
(``world.reform()``) and go on. ``--kill K:ITERATION`` makes the rank that its launcher numbered K kill
itself there, to watch a leave; ``--target`` ends the run once the best agent fits the curve that well
(benchmarks/elastic_population.py compares a population that grows with fixed ones).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time

import torch

import popmesh
from popmesh.population import Continuous, Explore, SelectiveAveraging
from popmesh.population.state.rejoin import seed_newcomers
from popmesh.torch import model_fingerprint

parser = argparse.ArgumentParser()
parser.add_argument("--iterations", type=int, default=400)
parser.add_argument("--every", type=int, default=20, help="iterations between the population's decisions")
parser.add_argument("--pace", type=float, default=0.02, help="seconds each iteration takes at least (a real step's)")
parser.add_argument("--kill", default="", metavar="K:ITERATION", help="the rank numbered K kills itself there")
parser.add_argument("--seed", type=int, default=0, help="the agents' initial weights and learning rates")
parser.add_argument("--target", type=float, default=0.0, help="stop once the best agent's squared error is this low")
parser.add_argument("--log-every", type=int, default=0, help="rank 0 says the best error every this many iterations")
args = parser.parse_args()


def build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


# A process that would join with another model is refused before the running world sees it.
world = popmesh.init(timeout=60, fingerprint=model_fingerprint(build()))
me = world.roster[world.rank]  # the launcher's number for this rank: it stays when ranks are renumbered
victim, kill_at = (int(part) for part in args.kill.split(":")) if args.kill else (-1, -1)

inputs = torch.linspace(-2, 2, 256).unsqueeze(1)
targets = torch.sin(3 * inputs) + 0.1 * torch.randn(inputs.shape, generator=torch.Generator().manual_seed(0))
torch.manual_seed(1000 * args.seed + me)
model = build()
lr = 10 ** float(torch.empty(1).uniform_(-4, -1))
opt = torch.optim.Adam(model.parameters(), lr=lr)
explore = Explore(keys=("lr",), space={"lr": Continuous(1e-4, 1e-1, log=True)})  # resampled within the initial range
policy = SelectiveAveraging(args.every, optimizer_policy="copy", explore=explore, seed=args.seed)


def metric() -> float:
    """The agent's score: minus its mean squared error over the whole curve (higher is better)."""
    with torch.no_grad():
        return -float(torch.nn.functional.mse_loss(model(inputs), targets))


def take_in(iteration: int) -> int:
    """Seed the ranks that just joined (or were restarted) from the best agents; everyone's iteration."""
    seeding = seed_newcomers(model, opt, metric(), {"iteration": iteration}, donors=2, explore=explore, seed=args.seed)
    if seeding is None:
        return iteration
    if world.rank in seeding.newcomers:
        print(f"rank {world.rank} (launcher rank {me}) joined a world of {world.size} at iteration "
              f"{seeding.counters['iteration']}, seeded by mean(rank {', rank '.join(map(str, seeding.donors))}), "
              f"lr {seeding.explored['lr'][0]:.2e} explored to {seeding.explored['lr'][1]:.2e}", flush=True)
    return int(seeding.counters["iteration"])


iteration = take_in(0) if world.rank in world.newcomers else 0
while iteration < args.iterations:
    if me == victim and iteration == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    iteration += 1
    time.sleep(args.pace)
    if iteration % args.every:
        continue
    size = world.size
    try:
        model, opt, info = policy(iteration, model, opt, metric())
        if world.admit():  # a launcher started later waits: take its ranks in here, all together
            iteration = take_in(iteration)
    except popmesh.PeerFailure as lost:  # a rank left for good (or is being restarted)
        world.reform()
        iteration = take_in(int(popmesh.broadcast(torch.tensor([iteration]), src=0)[0]))
        print(f"rank {world.rank} (launcher rank {me}) went on in a world of {world.size} after losing "
              f"rank(s) {list(lost.ranks)} at iteration {iteration}", flush=True)
        continue
    if world.rank == 0 and world.size != size:
        print(f"iteration {iteration}: the world grew from {size} to {world.size} ranks", flush=True)
    best_error = -max(info.metrics.values())  # every rank saw every agent's metric at this decision
    if world.rank == 0 and args.log_every and iteration % args.log_every == 0:
        print(f"iteration {iteration}: best squared error {best_error:.4f}, {world.size} agents", flush=True)
    if best_error <= args.target:
        if world.rank == 0:
            print(f"target {args.target:g} reached at iteration {iteration} with {world.size} agents", flush=True)
        break

best = popmesh.all_reduce(torch.tensor([metric()]), op=popmesh.ReduceOp.MAX)
if world.rank == 0:
    print(f"done: {world.size} agents at iteration {iteration}, best mean squared error {-float(best[0]):.4f} "
          f"(finite: {math.isfinite(float(best[0]))})", flush=True)
