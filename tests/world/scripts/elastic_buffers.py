"""The replay-buffer service through a world that grows and shrinks: ``elastic_buffers.py KILL_AT`` under
``popmesh launch --nnodes 1:2 -n 3`` on each of two launchers (node 0 first, node 1 later).

Node 0's three ranks form the world: an agent (rank 0), the manager (rank 1) and the coordinator (rank 2)
(assign_roles). Node 1's three ranks join it as agents, served by the same manager. Launcher rank 0 (the
first agent) SIGKILLs itself after KILL_AT batches, with no restart left, so it leaves for good: the ranks
above it move down. Every agent polls ``world.newcomer_waiting()`` once per batch and re-forms when it is
due or a call failed; the manager and the coordinator re-form by themselves. Each agent sends BATCHES
batches of ROWS rows whose states carry (launcher number, index); the manager prints what it stored, the
coordinator the modes (one per agent) it counted, and each rank every (generation, rank, size) it saw.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import popmesh
from popmesh import PeerFailure
from popmesh.buffers import Coordinator, ReplayBufferClient, ReplayBufferManager

BATCHES, ROWS = 120, 4
kill_at = int(sys.argv[1])
world = popmesh.init(timeout=60)
me = world.roster[world.rank]
ctx = popmesh.assign_roles(world, num_buffers=1, use_coordinator=True)
seen = [(world.generation, world.rank, world.size)]


def modes(batch, store):
    """Each agent's first batch is a mode of its own (reported to the coordinator)."""
    return {"score": 0.0, "modes": [f"agent {int(batch['states'][0, 0])}"]}


if ctx.is_buffer_rank():
    manager = ReplayBufferManager.from_context(ctx, scoring_function=modes)
    stats = manager.run()
    states = manager.store.column("states")
    pairs = [(int(a), int(b)) for a, b in states[:, :2].tolist()] if states is not None else []
    print("MANAGER " + json.dumps({"stats": stats.to_dict(), "rows": len(pairs), "pairs": pairs,
                                   "served": sorted(manager.served), "seen": seen + [(world.generation, world.rank,
                                                                                      world.size)]}), flush=True)
elif ctx.is_coordinator_rank():
    found = Coordinator.from_context(ctx).run()
    print("COORDINATOR " + json.dumps({"stats": found, "seen": [(world.generation, world.rank, world.size)]}),
          flush=True)
else:
    client = ReplayBufferClient.from_context(ctx, mode="sync")

    def regroup() -> None:
        world.reform()
        ctx.rebuild()
        client.reconnect()
        seen.append((world.generation, world.rank, world.size))
        assert ctx.assigned_buffer == ctx.layout.buffer_ranks[0] and ctx.is_training_rank(), ctx.layout.summary()

    i, due = 0, False
    while i < BATCHES:
        if me == 0 and i >= kill_at and world.size == 6:  # once node 1 joined
            os.kill(os.getpid(), signal.SIGKILL)
        if due or world.newcomer_waiting():
            try:
                regroup()
                due = False
            except PeerFailure as e:  # lost again while re-forming: form the next one
                print(f"AGENT {me} re-forming again at batch {i}: {e}", flush=True)
            continue
        batch = {"states": np.tile(np.array([me, i], np.float32), (ROWS, 1)), "log_rewards": np.zeros(ROWS)}
        try:
            client.add(batch)
        except PeerFailure:  # the manager left this generation, or a peer was lost: reconnect() sends it again
            due = True
        i += 1
        time.sleep(0.05)
    client.drain()
    print(f"AGENT {me} " + json.dumps({"sent": client.sent, "seen": seen}), flush=True)
world.finalize()
