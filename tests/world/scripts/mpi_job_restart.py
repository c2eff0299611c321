"""An MPI population that outlives a lost rank by restarting whole: ``mpi_job_restart.py DIR STEPS KILL_AT``.

Each rank trains a one-weight agent: every step all-reduces rank + 1 and adds the sum times the step to its
weight, so the final weight is a closed form that any lost or repeated step would change. Every 5 steps the
population is checkpointed into DIR (popmesh's Checkpointer). Rank 1's process in the job's first run
(TORCHELASTIC_RESTART_COUNT 0) SIGKILLs itself at step KILL_AT; under ``popmesh launch --engine mpi
--max-restarts 1`` the whole job starts again, every rank takes its agent back from the newest complete
checkpoint and trains to the end. Prints RESUMED (with the wall clock) and DONE lines.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

import popmesh
from popmesh.population.state.checkpoint import AgentState, Checkpointer, latest_checkpoint, load_agent

folder, steps, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
world = popmesh.init()
weight = torch.zeros(1)
start = 0
found = latest_checkpoint(folder) if restart else None
if found is not None:
    agent = load_agent(found, world.rank, world.size)
    weight, start = agent.model["weight"].clone(), int(agent.counters["step"])
    print(f"RESUMED rank={world.rank} restart={restart} step={start} t={time.time():.3f}", flush=True)
checkpoints = Checkpointer(folder, every=5, keep=2)
for step in range(start, steps):
    if world.rank == 1 and restart == 0 and step == kill_at:
        print(f"KILLING rank=1 t={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    total = popmesh.all_reduce(np.array([world.rank + 1.0]), timeout=60)
    weight += float(total[0]) * step
    if checkpoints.due(step + 1):
        checkpoints.save(step + 1, AgentState(model={"weight": weight}, counters={"step": step + 1}), timeout=60)
print(f"DONE rank={world.rank} restart={restart} weight={float(weight[0])}", flush=True)
world.finalize()
