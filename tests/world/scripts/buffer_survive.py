"""The replay-buffer service through a lost agent: ``buffer_survive.py MODE`` under ``popmesh launch -n 3
--max-restarts 1``: two agents and a manager (assign_roles). The higher agent's first process SIGKILLs
itself after DIE_AT batches; the other agent ends only once it has re-formed with the others. The
manager re-forms by itself; the other agent re-forms when the heartbeat or a failed call says so,
rebuilds its roles' groups and reconnects its client (which sends again the batch whose score had not
arrived); the restarted agent sends all its batches from the first. Each agent sends BATCHES batches of
ROWS rows whose states carry (rank, index); the manager prints what it stored.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import popmesh
from popmesh import PeerFailure
from popmesh.buffers import ReplayBufferClient, ReplayBufferManager

BATCHES, ROWS, DIE_AT = 24, 4, 6
mode = sys.argv[1]
world = popmesh.init()
ctx = popmesh.assign_roles(world, num_buffers=1)
if ctx.is_buffer_rank():
    manager = ReplayBufferManager.from_context(ctx)
    stats = manager.run()
    states = manager.store.column("states")
    stored = sorted({(int(a), int(b)) for a, b in states[:, :2].tolist()}) if states is not None else []
    print("MANAGER " + json.dumps({"stats": stats.to_dict(), "rows": len(states), "distinct": stored}), flush=True)
else:
    victim = max(ctx.training_ranks)
    first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    client = ReplayBufferClient.from_context(ctx, mode=mode)
    i = 0
    deadline = time.monotonic() + 60
    # The run ends in one generation: a survivor that sent all its batches before it heard of the loss
    # waits for the heartbeat to name it and re-forms with the others (as the demo meets them at its end).
    while i < BATCHES or (world.generation == 0 and world.rank != victim and time.monotonic() < deadline):
        if world.rank == victim and i == DIE_AT and first_process:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            lost = world.failure()
            if lost is not None:
                raise lost
            if i < BATCHES:
                batch = {"states": np.tile(np.array([world.rank, i], np.float32), (ROWS, 1)),
                         "log_rewards": np.zeros(ROWS)}
                client.add(batch)
                i += 1
            time.sleep(0.05)
        except PeerFailure as e:
            print(f"AGENT {world.rank} lost a peer at batch {i}: {e}", flush=True)
            world.reform()
            ctx.rebuild()
            client.reconnect()
    client.drain()
    print(f"AGENT {world.rank} done sent={client.sent} generation={world.generation}", flush=True)
world.finalize()
