"""spawn_policy used as upstream's users do: nothing calls popmesh.init(); the facade starts the world."""

import os

import torch

import popmesh
import popmesh.compat.spawn_policy as sp

rank = int(os.environ.get("PMI_RANK") or os.environ.get("RANK", "0"))
model = torch.nn.Linear(1, 1, bias=False)
with torch.no_grad():
    model.weight.fill_(rank + 1.0)
policy = sp.AverageAllPolicy(average_every=1)
_, _, info = policy(1, model, None)
world = popmesh.current_world()
assert info["averaged_this_iteration"] is True
assert float(model.weight) == (world.size + 1) / 2, float(model.weight)
print(f"NOINIT rank={world.rank} size={world.size} ok", flush=True)
