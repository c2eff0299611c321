"""Worker for tests/world/test_launcher.py: behaves as argv[1] says, records its pid.

Modes: ok (print and exit 0), env (print the launch variables as JSON), raise (rank 1 raises),
sigkill (rank 1 SIGKILLs itself), hang (rank 1 ignores SIGTERM and sleeps forever, rank 0
prints the time and exits 1), sleep (every rank sleeps forever). The pid goes to
$POPMESH_TEST_PIDDIR/<rank>.pid when that is set.
"""

import json
import os
import signal
import sys
import time

RANK = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
KEYS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "POPMESH_ENGINE", "POPMESH_STORE_FD", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "POPMESH_PARENT_PID",
)


def fail_in_rank_one() -> None:
    raise ValueError(f"deliberate failure in rank {RANK}")


def main(mode: str) -> None:
    piddir = os.environ.get("POPMESH_TEST_PIDDIR")
    if piddir:  # write, then rename: a reader never sees an empty file
        tmp = os.path.join(piddir, f"{RANK}.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(piddir, f"{RANK}.pid"))
    if mode == "ok":
        print(f"hello from {RANK} args={sys.argv[2:]}")
        print(f"err line {RANK}", file=sys.stderr)
    elif mode == "env":
        print("ENV " + json.dumps({k: os.environ.get(k) for k in KEYS}))
    elif mode == "raise" and RANK == 1:
        time.sleep(0.2)
        fail_in_rank_one()
    elif mode == "sigkill" and RANK == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), 9)
    elif mode == "hang" and RANK == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL after the grace period stops it
        time.sleep(1000)
    elif mode == "hang" and RANK == 0:
        time.sleep(0.3)
        print(f"FAILING AT {time.time():.6f}", flush=True)
        sys.exit(1)
    elif mode in ("raise", "sigkill", "hang", "sleep"):
        time.sleep(1000)


if __name__ == "__main__":
    main(sys.argv[1])
