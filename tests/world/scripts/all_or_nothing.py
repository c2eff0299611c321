"""All-or-nothing data-parallel steps: ``all_or_nothing.py STEPS KILL_AT [UNEVEN]``.

Three ranks train a 4-layer MLP with Adam and ``GradientSync`` over small buckets (about one layer
each), every rank on its own seeded batch. At step KILL_AT rank 2's first process SIGKILLs itself
inside backward, once the gradient of the first layer (the last bucket to fill) is computed: the
other buckets' reductions are in flight or done, the last one never starts. The survivors' sync
fails, they re-form the world with the restarted process and call
``hand_over(..., applied=steps_applied, donors=2)``. With UNEVEN=1 rank 1 applies the failed step anyway
before re-forming (as a rank whose reductions had all completed would), so the survivors' counts
differ. Lines: ``BEFORE rank step digest`` (the state as the failed step began), ``AFTER rank step
digest`` (once the state was handed over), ``DONE rank step digest generation`` at the end, where
digest is a SHA-256 of every parameter and every optimizer state tensor.
"""

import hashlib
import os
import signal
import sys

import torch

import popmesh
from popmesh.torch import GradientSync, hand_over

steps, kill_at = int(sys.argv[1]), int(sys.argv[2])
uneven = len(sys.argv) > 3 and sys.argv[3] == "1"
world = popmesh.init()
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial weights everywhere
model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def digest() -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            h.update(torch.as_tensor(state[key]).detach().numpy().tobytes())
    return h.hexdigest()[:16]


def die_in_backward() -> None:
    """SIGKILL this process once the first layer's weight has its gradient: mid-step, mid-reductions."""
    model[0].weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


step = 0
if world.newcomers:
    step = hand_over(model, opt, None, applied=None, donors=2)["step"]
    print(f"AFTER {world.rank} {step} {digest()}", flush=True)
sync = GradientSync(model, cap_bytes=20_000)
assert len(sync.plan.buckets) >= 4, sync
while step < steps:
    if step == kill_at and world.rank == 2 and world.restart_count == 0:
        die_in_backward()
    before = digest()
    torch.manual_seed(1000 * step + world.rank)
    x = torch.randn(16, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    try:
        loss.backward()  # the buckets filled first are reduced during backward: a loss may surface here
        sync()
    except popmesh.PeerFailure:
        print(f"BEFORE {world.rank} {step} {before}", flush=True)
        sync.close()
        if uneven and world.rank == 1:
            opt.step()  # as if this rank's reductions had completed: it is one step ahead of rank 0
            step += 1
        world.reform()
        step = hand_over(model, opt, {"step": step}, applied=step, donors=2)["step"]
        print(f"AFTER {world.rank} {step} {digest()}", flush=True)
        sync = GradientSync(model, cap_bytes=20_000)
        continue
    opt.step()
    step += 1
print(f"DONE {world.rank} {step} {digest()} {world.generation}", flush=True)
popmesh.barrier()
