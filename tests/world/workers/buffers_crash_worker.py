"""A crashed manager or coordinator is an error on its client, never a hang: trainer 0, manager 1,
coordinator 2. The coordinator dies at once; the manager answers one DATA, then dies."""

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import CommTimeout, PeerFailure
from popmesh.buffers import ReplayBufferClient, ReplayBufferManager
from popmesh.buffers.protocol import REQUEST_TAG, from_payload
from popmesh.buffers.service import send_outgoing
from popmesh.comm import messages as m
from worldlib import check, main

BATCH = {"states": np.ones((4, 8), np.float32), "log_rewards": np.zeros(4)}


def expect_failure(call, limit):
    start = time.monotonic()
    try:
        call()
    except (PeerFailure, CommTimeout) as e:
        assert time.monotonic() - start < limit, time.monotonic() - start
        return e
    raise AssertionError("talking to a dead rank must fail")


@check
def dead_service_ranks_surface_as_errors(w):
    ctx = popmesh.assign_roles(w, num_buffers=1, use_coordinator=True)
    popmesh.barrier()
    if ctx.is_coordinator_rank():
        os._exit(3)
    if ctx.is_buffer_rank():
        manager = ReplayBufferManager.from_context(ctx, coordinator_rank=None)  # its coordinator is dead
        src, payload = m.recv(None, REQUEST_TAG, timeout=30)
        for out in manager.handle(src, from_payload(payload)):
            send_outgoing(out, None, 30).wait()
        time.sleep(1.0)  # let the reply leave before dying
        os._exit(3)
    client = ReplayBufferClient.from_context(ctx, timeout=5)
    assert client.add(BATCH)["score"] == math.inf
    time.sleep(2.0)  # both service ranks are gone now
    errors = [expect_failure(lambda: client.add(BATCH), 20), expect_failure(client.population_stats, 20)]
    print("failures seen:", [type(e).__name__ for e in errors], flush=True)
    said = [f"the replay-buffer manager (rank {ctx.assigned_buffer}) was lost",
            f"the replay-buffer coordinator (rank {ctx.coordinator_rank}) was lost"]
    for error, words in zip(errors, said):  # a loss is said as such; silence stays a CommTimeout
        assert isinstance(error, CommTimeout) or words in str(error), (words, str(error))


if __name__ == "__main__":
    main()
