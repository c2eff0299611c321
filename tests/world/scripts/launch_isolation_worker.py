"""Worker for tests/world/test_launch_isolation.py: form a world, report, wait for the test, end as told.

``argv[1]``: ``hold`` (every rank exits 0 once released), ``kill`` (rank 1 SIGKILLs itself once
released, the others wait to be torn down) or ``raise`` (rank 1 raises once released). The world is
formed on the engine in ``POPMESH_ENGINE`` (mpi4py, or torch gloo through the launcher's store
socket). Each rank then writes ``$POPMESH_TEST_PIDDIR/<rank>.json``: its pid, the MPICH
shared-memory segments it has open and the gloo interface variable; the test releases the ranks by
creating ``$POPMESH_TEST_PIDDIR/release``.
"""

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

ENGINE = os.environ["POPMESH_ENGINE"]
PIDDIR = os.environ["POPMESH_TEST_PIDDIR"]


def form_world() -> tuple[int, Callable[[], object]]:
    """Rank and a barrier callable, on the launcher's engine."""
    if ENGINE == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        comm.Barrier()
        return comm.rank, comm.Barrier
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fd = os.environ.get("POPMESH_STORE_FD")
    master = {"master_listen_fd": int(fd), "wait_for_workers": False} if fd else {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, bool(fd),
                          timeout=timedelta(seconds=30), **master)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()
    return rank, dist.barrier


def open_segments() -> list[str]:
    """Names of the /dev/shm/mpich_* files this process has open."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/mpich_"):
            names.append(os.path.basename(target))
    return sorted(set(names))


def report(rank: int) -> None:
    info = {"pid": os.getpid(), "shm": open_segments(), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    tmp = os.path.join(PIDDIR, f"{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(PIDDIR, f"{rank}.json"))


def wait_for_release(limit: float = 40.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(PIDDIR, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(mode: str) -> None:
    rank, barrier = form_world()
    report(rank)
    wait_for_release()
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise" and rank == 1:
        raise RuntimeError("deliberate failure in rank 1")
    if mode in ("kill", "raise"):
        time.sleep(60)  # torn down by mpiexec
    barrier()


if __name__ == "__main__":
    main(sys.argv[1])
