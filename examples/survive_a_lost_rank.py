# run: popmesh launch -n 3 --max-restarts 2 examples/survive_a_lost_rank.py --kill-at 30
"""Data-parallel training that outlives a lost rank.

The launcher restarts a rank that dies (--max-restarts); the survivors catch the PeerFailure, call
world.reform(), and hand the newcomer the model, the optimizer state and the step; the newcomer finds
itself in world.newcomers after init() and takes the same hand-off. No rank starts over, and the step
during which the rank was lost is applied by none (``applied=``).
"""

import argparse
import os
import signal

import torch

import popmesh
from popmesh.torch import GradientSync, broadcast_params_, donor_of, hand_over

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--kill-at", type=int, default=-1, help="rank 1's first process kills itself at this step")
args = parser.parse_args()

world = popmesh.init()
torch.manual_seed(world.rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
step = 0


def catch_up() -> None:
    """Every rank takes the weights, optimizer state and step of the lowest rank that survived; a peer
    lost meanwhile (a second failure) re-forms the world again first."""
    global step
    while True:
        try:
            step = hand_over(model, opt, step, applied=step)  # a step applied by some survivors only is undone
            break
        except popmesh.PeerFailure as e:
            print(f"rank {world.rank} lost a peer while catching up: re-forming ({e.ranks})")
            world.reform()
    if world.rank in world.newcomers:
        print(f"rank {world.rank} rejoined at step {step} (generation {world.generation}, from rank {donor_of()})")


def recover(e: popmesh.PeerFailure) -> None:
    """A peer was lost: re-form the world with its restarted process and catch up."""
    print(f"rank {world.rank} lost a peer at step {step}: re-forming ({e.ranks})")
    world.reform()
    catch_up()


if world.newcomers:  # this process was restarted for a lost rank
    catch_up()
else:
    try:
        broadcast_params_(model, src=0)
    except popmesh.PeerFailure as e:  # lost before the first step: the survivors' weights are as good
        recover(e)
sync = GradientSync(model)
while step < args.steps:
    if step == args.kill_at and world.rank == 1 and world.restart_count == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the demonstration's lost rank
    x = torch.randn(32, 8)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    try:
        loss.backward()  # the buckets filled first are reduced during backward
        sync()
    except popmesh.PeerFailure as e:
        sync.close()
        recover(e)
        sync = GradientSync(model)
        continue
    opt.step()
    step += 1
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
while True:
    try:
        agree = bool(popmesh.all_reduce(weights, "max").equal(popmesh.all_reduce(weights, "min")))
        break
    except popmesh.PeerFailure as e:  # lost at the very end: the restarted process takes the final state
        recover(e)
print(f"rank {world.rank} done at step {step}, generation {world.generation}, weights agree: {agree}")
