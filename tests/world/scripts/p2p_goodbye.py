"""gloo goodbyes: every rank hears from every peer, the last rank finalizes early, the others learn it
at once (PeerClosed, a PeerFailure, not a timeout; in a world of two also for an any-source receive)
and everyone exits cleanly (no abort at interpreter exit)."""

import sys
import time

import numpy as np

import popmesh
from popmesh.comm import messages as m
from popmesh.core.errors import PeerClosed, PeerFailure

world = popmesh.init()
rank, size = world.rank, world.size
for i in range(20):  # any-source receives on two tags: every rank has a pump for every peer
    handles = [m.isend(np.array([rank, i]), peer, tag=1 + i % 2) for peer in range(size) if peer != rank]
    for _ in range(size - 1):
        src, got = m.recv(None, tag=1 + i % 2, timeout=30)
        assert got.tolist() == [src, i], (src, got)
    for h in handles:
        h.wait(30)
popmesh.barrier(timeout=30)
early = size - 1
if rank == early:
    m.send("last words", 0, tag=3)
    start = time.monotonic()
    world.finalize()
    print(f"EARLY finalized in {time.monotonic() - start:.2f} s")
    sys.exit(0)
if rank == 0:
    assert m.recv(early, tag=3, timeout=30) == (early, "last words")  # queued before the goodbye
start = time.monotonic()
try:
    m.recv(early, tag=3, timeout=30)
except PeerFailure as e:
    assert "closed its point-to-point transport" in str(e), e
    assert isinstance(e, PeerClosed), f"a goodbye is an orderly close, not a broken connection: {e!r}"
    assert time.monotonic() - start < 10, time.monotonic() - start
else:
    raise AssertionError("a receive from a rank that finalized must raise PeerFailure")
if size == 2:  # every possible sender is gone: an any-source receive fails at once too
    start = time.monotonic()
    try:
        m.recv(None, tag=3, timeout=30)
    except PeerFailure as e:
        assert isinstance(e, PeerClosed), repr(e)
        assert time.monotonic() - start < 10, time.monotonic() - start
    else:
        raise AssertionError("an any-source receive with every peer gone must raise PeerFailure")
try:
    m.send("too late", early, tag=4)
except PeerFailure:
    pass
else:
    raise AssertionError("a send to a rank that finalized must raise PeerFailure")
print(f"rank {rank} OK")
