"""A manager outlives a lost agent when nothing restarts it: two trainers and a manager. The higher
trainer dies after two batches; the manager serves the other to the end, counts the dead one lost,
and returns."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh.buffers import ReplayBufferClient, ReplayBufferManager
from worldlib import check, main

ROWS, BATCHES = 4, 12


def batch(i):
    return {"states": np.full((ROWS, 3), float(i), np.float32), "log_rewards": np.zeros(ROWS)}


@check
def a_lost_agent_is_a_hole_the_manager_serves_around(w):
    ctx = popmesh.assign_roles(w, num_buffers=1)
    popmesh.barrier()
    if ctx.is_buffer_rank():
        stats = ReplayBufferManager.from_context(ctx, timeout=20).run(idle_timeout=20)
        alive, dying = min(ctx.training_ranks), max(ctx.training_ranks)
        assert stats.lost == {dying: 1}, stats
        assert stats.rows_from[alive] == ROWS * BATCHES and stats.rows_from[dying] == 2 * ROWS, stats
        print("MANAGER", stats.to_dict(), flush=True)
        return
    client = ReplayBufferClient.from_context(ctx, timeout=20)
    for i in range(BATCHES):
        if w.rank == max(ctx.training_ranks) and i == 2:
            os._exit(3)
        assert client.add(batch(i))["rows"] == ROWS
        time.sleep(0.15)  # trainer 1 dies while trainer 0 still sends
    client.drain()


if __name__ == "__main__":
    main()
