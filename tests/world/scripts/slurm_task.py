"""A task started as srun starts it (only SLURM_* variables): the world forms and computes."""

import numpy as np

import popmesh

world = popmesh.init()
total = popmesh.all_reduce(np.array([world.rank + 1.0]), timeout=60)
print(f"TASK rank={world.rank} size={world.size} local={world.local_rank} sum={float(total[0])}", flush=True)
world.finalize()
