"""Rank 0 floods rank 1, which does not receive for a while: the bytes rank 1 holds stay bounded
(gloo: under POPMESH_P2P_BUFFER_BYTES plus two frames; MPI: rank 0 keeps at most its window of
POPMESH_P2P_BUFFER_BYTES in flight to it, and the rest waits at rank 0), a blocking send past the
bound times out naming rank 1, the heartbeat does
not mistake the held-back sender for a dead one, and once rank 1 receives, every message arrives
intact and in order. Then messages on many tags: the per-tag tables shrink back. Two ranks;
argv[1]: frames in the flood (of 256 KiB)."""

import os
import sys
import time

import numpy as np
from scriptlib import resident_bytes

import popmesh
from popmesh.comm import messages as m
from popmesh.core.errors import CommTimeout

FRAME = 256 << 10
world = popmesh.init()
rank, engine = world.rank, world.engine_name
p2p = world.engine.p2p()
count = int(sys.argv[1])
stall = float(os.environ.get("FLOOD_STALL_S", "5"))


if rank == 0:
    handles = [m.isend(np.full(FRAME // 8, i, dtype=np.int64), 1, tag=7) for i in range(count)]
    started = time.monotonic()
    try:
        m.send(np.full(FRAME // 8, count, dtype=np.int64), 1, tag=7, timeout=2)
        print(f"rank 0 extra send returned (nothing held it back) after {time.monotonic() - started:.1f} s")
    except CommTimeout as e:
        assert e.missing == (1,), e.missing
        assert "rank 1" in str(e), str(e)
        print(f"rank 0 extra send timed out naming rank 1 OK: {str(e)[:100]}")
    if engine == "mpi":
        mem = p2p.memory()
        assert mem["in_flight_bytes"] <= mem["window_bytes"] and mem["waiting_frames"] > 0, mem
    popmesh.barrier()  # rank 1 measured what it holds
    for h in handles:
        h.wait(120)
    popmesh.barrier()
    for tag in range(100, 400):
        m.isend(b"t", 1, tag=tag)
    popmesh.barrier()
    time.sleep(1.2)  # the send workers reap the eager sends, and the pruning interval passes
    m.send(b"t", 1, tag=400, timeout=30)  # a new channel: the idle ones are pruned
    mem = p2p.memory()
    print(f"rank 0 memory after 301 tags: {mem}")
    if engine == "torch":
        assert mem["send_channels"] <= 8, mem
    else:
        assert mem["held_sends"] <= 600, mem
else:
    before = resident_bytes()
    time.sleep(stall)  # rank 0 floods meanwhile; nobody here receives
    mem, grown = p2p.memory(), resident_bytes() - before
    print(f"rank 1 holds after {stall:g} s of flood: {mem}, RSS grown by {grown / 2**20:.1f} MiB "
          f"(flood {count * FRAME / 2**20:.0f} MiB)")
    if engine == "torch":
        assert mem["held_bytes"] <= mem["cap"] + 2 * (FRAME + 4096), mem
        assert p2p.holding_back(), mem
    assert grown < count * FRAME / 2, f"grew {grown} bytes while {count * FRAME} were sent"
    assert world.failure() is None, f"the held-back sender was taken for dead: {world.failure()}"
    popmesh.barrier()
    for i in range(count + 1):
        src, got = m.recv(0, tag=7, timeout=60)
        assert src == 0 and got.shape == (FRAME // 8,) and int(got[0]) == i and int(got[-1]) == i, (i, got[:2])
    print(f"rank 1 received all {count + 1} frames intact and in order OK")
    popmesh.barrier()
    for tag in range(100, 400):
        assert m.recv(0, tag=tag, timeout=60) == (0, b"t")
    popmesh.barrier()
    assert m.recv(0, tag=400, timeout=60) == (0, b"t")
    mem = p2p.memory()
    print(f"rank 1 memory after 300 tags: {mem}")
    assert mem["posted_tags"] <= 1, mem  # the heartbeat's receive
    if engine == "torch":
        # at most a heartbeat note the heartbeat thread has not taken yet
        assert mem["held_bytes"] < 1024 and mem["inbox_tags"] <= 1 and not p2p.holding_back(), mem
    else:
        assert mem["partial_tags"] == 0, mem
print(f"rank {rank} flood OK")
world.finalize()
