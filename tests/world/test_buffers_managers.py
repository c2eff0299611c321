"""Two replay-buffer managers and a coordinator, made by the torchgfn facade from the ranks' host names:
a world of 5 ranks on one host (torch/gloo; MPI with a layout passed in), and the same world over two
hosts (network namespaces, ranks placed a, b, a, b, a), where each manager must sit on the host of the
trainer it serves. Data goes in, metadata comes out, and the coordinator's global baseline reaches both
managers and filters both trainers' batches. The training files (population, buffers, compat) share one
world per engine and size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hosts import TwoHosts, unavailable
from workers import buffers_managers_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")

world_run, test_check, test_world_exits_cleanly = world_tests(worker, [("torch", 5), ("mpi", 5)], timeout=90,
                                                              suite="training")

SCRIPT = Path(__file__).parent / "scripts" / "hosts_buffers.py"
_STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE",
          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.mark.timeout(120)
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_managers_sit_with_their_trainers_across_two_hosts():
    """Ranks 0, 2, 4 on host a and 1, 3 on host b, started as torchrun starts them (RANK, WORLD_SIZE,
    MASTER_ADDR): managers 2 (a) and 3 (b) serve trainers 0 (a) and 1 (b); the coordinator is rank 4 (a)."""
    base = {k: v for k, v in os.environ.items() if k not in _STALE and not k.startswith(("SLURM_", "PMI_", "OMPI_"))}
    with TwoHosts() as th:
        a, b = th.hosts
        port = 29620  # host a's namespace is new: nothing else listens there
        procs = []
        for rank in range(5):
            host, local = th.hosts[rank % 2], rank // 2
            env = {**base, "RANK": str(rank), "WORLD_SIZE": "5", "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": "3" if host is a else "2", "MASTER_ADDR": a.addr, "MASTER_PORT": str(port),
                   "POPMESH_TIMEOUT": "60"}
            procs.append(host.start([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env))
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=100)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    text = "\n".join(outputs)
    assert [p.returncode for p in procs] == [0] * 5, text[-6000:]
    seen = {int(m[1]): m[2] for m in re.finditer(r"BUFFERS rank=(\d) host=(\S+) ok", text)}
    assert seen == {0: a.name, 1: b.name, 2: a.name, 3: b.name, 4: a.name}, text[-6000:]
