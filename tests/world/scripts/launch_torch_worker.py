"""gloo world through the launcher's pre-bound store socket; prints the all_reduce of rank+1.

With argv[1] == "bench" it prints READY <wall time> after init_process_group and one barrier
(benchmarks/launch.py); under torchrun (no POPMESH_STORE_FD) it uses the env:// rendezvous.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if "POPMESH_ENGINE" in os.environ:  # popmesh launch: rank 0 serves the store on the given socket
    fd = os.environ.get("POPMESH_STORE_FD")
    master = {"master_listen_fd": int(fd), "wait_for_workers": False} if fd else {}
    store = dist.TCPStore(addr, port, world, bool(fd), timeout=timedelta(seconds=30), **master)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:  # torchrun: env:// against the agent's store
    dist.init_process_group("gloo")
dist.barrier()
if len(sys.argv) > 1 and sys.argv[1] == "bench":
    print(f"READY {time.time():.6f}", flush=True)
else:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"torch rank {rank} sum={value.item():g}")
dist.destroy_process_group()
