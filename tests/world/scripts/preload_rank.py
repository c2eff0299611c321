"""A rank of ``popmesh launch --preload``: reports what it was forked with, then exits as the test asks.

argv: OUT_DIR MODE [ARGS...]; MODE is ``report`` (an all_reduce, then a JSON report per rank),
``exit-message`` (sys.exit with a text), ``threads`` (a non-daemon thread and an executor still busy at
the end of the script, and an atexit hook), ``kill-1`` (rank 1 kills itself once; with --max-restarts
its restart reports).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import popmesh

out, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "exit-message":
    sys.exit("leaving with a message")
if mode == "threads":
    atexit.register(lambda: print("ATEXIT after the thread", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.4), print("THREAD done", flush=True))).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(time.sleep, 0.2)
    sys.exit(0)

world = popmesh.init()
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if mode == "kill-1" and world.rank == 1 and restarts == 0:
    os.kill(os.getpid(), signal.SIGKILL)
import torch

try:
    total = popmesh.all_reduce(torch.tensor([float(world.rank + 1)]))
except popmesh.PeerFailure:  # a survivor of the killed rank: form the world again with its restart
    world.reform()
    total = popmesh.all_reduce(torch.tensor([float(world.rank + 1)]))
(out / f"rank-{world.rank}.json").write_text(json.dumps({
    "rank": world.rank, "size": world.size, "env_rank": os.environ["RANK"], "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "cwd": os.getcwd(), "ppid": os.getppid(), "pid": os.getpid(), "pgid": os.getpgid(0),
    "random": random.random(), "numpy": float(np.random.rand()), "total": float(total[0]),
    "restarts": restarts, "torch_preloaded": "torch" in sys.modules, "stdin_tty": os.isatty(0),
}))
popmesh.finalize()
