"""AsyncSelectiveAveraging's reproducible mode (``lag=``) on a real world (torch/gloo and MPI).

Each rank trains a small linear regressor by SGD on its own seeded data, its learning rate explored,
every iteration sleeping a random time drawn from the OS (so reports arrive in another order on every
run). The record of a run: every replacement as the replaced rank saw it (applied and decision
iteration, donors, weights, explored values) and the final weights' bytes, written to
``$POPMESH_TEST_RECORD/rank<r>.json``. Two runs must write the same records; the test compares them.
"""

import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from popmesh.population import AsyncSelectiveAveraging, Continuous, Explore
from worldlib import check, main, need_ranks

EVERY, LAG, ITERATIONS = 4, 2, 48
EXPLORED = Explore(keys=("lr",), space={"lr": Continuous(1e-3, 0.5, log=True)})


def data_of(rank):
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(64, 8, generator=gen)
    return x, x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(64, generator=gen)


@check
def two_runs_with_the_same_seeds_are_bit_identical(w):
    need_ranks(w, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=[0.002, 0.3, 0.05, 0.01][w.rank % 4])
    policy = AsyncSelectiveAveraging(EVERY, lag=LAG, explore=EXPLORED, seed=3, timeout=60,
                                     latest={"relative_gap": 0.0, "absolute_gap": 0.0})
    x, y = data_of(w.rank)
    jitter = random.Random(os.urandom(8))
    applied = []
    for it in range(ITERATIONS):
        time.sleep(jitter.uniform(0, 0.02) * (3 if w.rank == w.size - 1 else 1))
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        due = it % EVERY == 0
        model, optimizer, info = policy(it, model, optimizer, -loss.item() if due else None)
        if info.replaced:
            assert it == info.decision_iteration + LAG, (it, info.decision_iteration)
            applied.append([it, info.decision_iteration, list(info.donors), list(info.weights), info.hparams_now])
    policy.shutdown(timeout=60)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    record = {"applied": applied, "weights": hashlib.sha256(weights).hexdigest(),
              "lr": optimizer.param_groups[0]["lr"]}
    out = os.environ["POPMESH_TEST_RECORD"]
    with open(os.path.join(out, f"rank{w.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
