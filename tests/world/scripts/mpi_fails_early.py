"""One rank fails before MPI starts, as a user's script does: argv[1] says how, argv[2] is a folder.

``import``: rank 1 imports a module that is not installed while the others initialise MPI and wait in a
barrier; ``args``: rank 1 is given an option its parser does not know (argparse exits 2) while the others
sleep and never initialise MPI; ``missing-file``: each rank reads ``FOLDER/<host>-rank<r>.cfg``, and the
rank whose file is missing raises FileNotFoundError while the others sleep; ``kill``: rank 1 is killed by
SIGKILL before MPI starts while the others sleep.

Every rank first records, in ``FOLDER/rank-<r>.procs``, itself and its ancestors up to the launcher
(Hydra's proxy, mpiexec, and on another host the shell chain that started the proxy) as ``pid start-time``
lines, so the test can check that none of them outlives the launch; the failing rank prints
``FAILING AT <wall clock>`` just before it fails.
"""

import argparse
import os
import signal
import socket
import sys
import time

RANK = int(os.environ["PMI_RANK"])
HOW, FOLDER = sys.argv[1], sys.argv[2]


def _stat(pid: int) -> tuple[int, str]:
    """(parent pid, start time) of ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), fields[19]


def _is_launcher(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    return any(args[i:i + 3] == [b"-m", b"popmesh", b"launch"] for i in range(len(args)))


def record_processes() -> None:
    lines, pid = [], os.getpid()
    while pid > 1 and not _is_launcher(pid):
        parent, started = _stat(pid)
        lines.append(f"{pid} {started}")
        pid = parent
    path = os.path.join(FOLDER, f"rank-{RANK}.procs")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def failing() -> None:
    print(f"FAILING AT {time.time():.6f}", flush=True)


record_processes()
time.sleep(0.5)  # every rank has recorded itself before one fails
if HOW == "import":
    if RANK == 1:
        failing()
        import popmesh_no_such_module  # noqa: F401
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
elif HOW == "args":
    parser = argparse.ArgumentParser(prog="train")
    parser.add_argument("--steps", type=int, default=1)
    if RANK == 1:
        failing()
    parser.parse_args(sys.argv[3:] + (["--lr", "3e-4"] if RANK == 1 else []))
elif HOW == "missing-file":
    path = os.path.join(FOLDER, f"{socket.gethostname()}-rank{RANK}.cfg")
    if not os.path.exists(path):
        failing()
    with open(path) as f:
        f.read()
elif HOW == "kill" and RANK == 1:
    failing()
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
