"""Two checkpoints of a 2-rank population; in the second, rank 1 is SIGKILLed half-way through writing
its file (and the launcher then tears rank 0 down)."""

import os
import signal
import sys

import torch

import popmesh
from popmesh.population.state.checkpoint import AgentState, Checkpointer

world = popmesh.init(timeout=20)
folder = sys.argv[1]
model = torch.nn.Linear(64, 64)
saver = Checkpointer(folder, every=1, group=world)
saver.save(1, AgentState(model.state_dict()))
if world.rank == 1:
    real_save = torch.save

    def dying_save(obj, f):
        real_save(obj, f)
        f.flush()
        os.ftruncate(f.fileno(), os.fstat(f.fileno()).st_size // 2)  # half the file is on disk
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = dying_save
saver.save(2, AgentState(model.state_dict()))
