"""A 2-rank smoke test of an installed popmesh: run from outside the checkout under ``popmesh launch``.

Checks that popmesh is imported from the environment it was installed into (``SMOKE_INSTALLED=1``), that a
collective and point-to-point messages give the closed-form answers, and, on MPI, which C-path state
the transport is in (``SMOKE_EXPECT_C_PATH``: ``in use`` for a wheel built with the C parts).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import popmesh
from popmesh.engines import mpi_native_status


def main() -> None:
    if os.environ.get("SMOKE_INSTALLED") == "1":
        where = os.path.realpath(popmesh.__file__)
        assert where.startswith(os.path.realpath(sys.prefix)), f"popmesh came from {where}, not from {sys.prefix}"
    world = popmesh.init()
    rank, size = world.rank, world.size
    assert size == 2, f"a world of {size}; the smoke test runs on 2 ranks"
    total = popmesh.all_reduce(np.array([rank + 1.0]), "sum")
    assert total[0] == 3.0, total
    peer = 1 - rank
    for payload in (b"abcd", np.arange(5, dtype=np.float32) + rank, np.zeros(300_000, np.uint8) + rank):
        if rank == 0:
            popmesh.send(payload, peer)
            source, back = popmesh.recv(peer)
        else:
            source, back = popmesh.recv(peer)
            popmesh.send(payload, peer)
        expected = payload if isinstance(payload, bytes) else payload - rank + peer
        assert source == peer and np.array_equal(np.asarray(back), np.asarray(expected)), (source, back)
    expected_state = os.environ.get("SMOKE_EXPECT_C_PATH")
    if world.engine_name == "mpi" and expected_state:
        state, reason = mpi_native_status() or ("no mpi4py", "")
        assert state == expected_state, f"the MPI C path is {state!r} ({reason}), expected {expected_state!r}"
    popmesh.barrier()
    if world.is_main:
        print(f"smoke: {world.engine_name} world of {size} from {os.path.dirname(popmesh.__file__)}: ok")
    world.finalize()


if __name__ == "__main__":
    main()
