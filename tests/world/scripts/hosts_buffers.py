"""The two-manager buffer service on a world spread over hosts: the checks of
``workers/buffers_managers_worker.py``, run in order; each rank reports its host once all passed."""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from workers import buffers_managers_worker as worker

world = popmesh.init()
for name in ("context_places_each_manager_with_its_trainers",
             "two_managers_reach_one_global_baseline_and_trainers_filter_by_it", "zz_all_done"):
    getattr(worker, name)(world)
print(f"BUFFERS rank={world.rank} host={socket.gethostname()} ok", flush=True)
world.finalize()
