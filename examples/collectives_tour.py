"""A tour of popmesh's collectives on a real world. Run: popmesh launch -n 4 examples/collectives_tour.py

Each rank holds its own "agent": a parameter vector and an episode return. The tour averages the
parameters, finds the best agent, gathers ragged replay batches and broadcasts a config, printing
what rank 0 sees.
"""

from __future__ import annotations

import time

import numpy as np

import popmesh


def main() -> None:
    world = popmesh.init()
    rank, n = world.rank, world.size
    rng = np.random.default_rng(rank)
    say = print if world.is_main else (lambda *a, **k: None)
    say(f"popmesh world: engine={world.engine_name} size={n} nodes={world.num_nodes}")

    params = {"w": rng.normal(size=(4, 4)).astype(np.float32), "b": np.full(4, float(rank), np.float32)}
    avg = popmesh.all_reduce(params, "avg")
    say(f"average bias over {n} ranks: {avg['b'][0]:.2f} (closed form {(n - 1) / 2:.2f})")

    episode_return = float(rng.normal(100 + 10 * rank, 5))
    returns = popmesh.all_gather(episode_return)
    best = int(np.argmax(returns))
    say("returns per rank: " + ", ".join(f"{r:.1f}" for r in returns) + f" → best agent: rank {best}")

    batch = rng.normal(size=(rank + 1, 3))  # each rank collected a different number of transitions
    pieces = popmesh.all_gather_ragged(batch)
    say(f"replay batches: sizes {[p.shape[0] for p in pieces]}, total {sum(p.shape[0] for p in pieces)}")

    config = popmesh.broadcast_object({"lr": 3e-4, "from": best} if rank == best else None, src=best)
    say(f"config broadcast from rank {best}: {config}")

    start = time.perf_counter()
    for _ in range(200):
        popmesh.all_reduce(np.float32(1.0))
    say(f"4-byte all_reduce latency: {(time.perf_counter() - start) / 200 * 1e6:.0f} µs")

    sub = world.new_group(list(range(0, n, 2)))
    if sub.is_member:
        share = popmesh.all_reduce(np.array([rank + 1.0]), "avg", group=sub)
        say(f"even ranks {list(sub.ranks)} average {share[0]:.2f} among themselves")
    popmesh.barrier()
    say("done")
    world.finalize()


if __name__ == "__main__":
    main()
