"""A popmesh world under torchrun: init() joins torchrun's agent store instead of serving its own."""

import numpy as np

import popmesh

world = popmesh.init()
total = popmesh.all_reduce(np.array([1.0]), timeout=60)
print(f"TORCHRUN rank={world.rank} size={world.size} sum={float(total[0])}", flush=True)
world.finalize()
