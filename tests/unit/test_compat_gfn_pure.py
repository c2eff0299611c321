"""torchgfn facade details its users' code and tests depend on, without a world: the upstream wrapper
tests (testing/test_distributed_wrappers.py) run against the facade with only the import changed."""

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import torch

import popmesh.compat.gfn as gfn

BOGUS = "nccl_fake"


@pytest.mark.parametrize("call", [
    lambda: gfn.send(torch.zeros(1), dst_rank=0, backend=BOGUS),
    lambda: gfn.isend(torch.zeros(1), dst_rank=0, backend=BOGUS),
    lambda: gfn.recv(src_rank=0, backend=BOGUS),
    lambda: gfn.barrier(backend=BOGUS),
    lambda: gfn.get_rank(backend=BOGUS),
    lambda: gfn.get_world_size(backend=BOGUS),
    lambda: gfn.all_reduce(torch.zeros(1), backend=BOGUS),
    lambda: gfn.all_gather([torch.zeros(1)], torch.zeros(1), backend=BOGUS),
    lambda: gfn.broadcast(torch.zeros(1), src=0, backend=BOGUS),
], ids=["send", "isend", "recv", "barrier", "get_rank", "get_world_size", "all_reduce", "all_gather", "broadcast"])
def test_an_unknown_backend_is_the_value_error_upstream_tests_match(call):
    with pytest.raises(ValueError, match="Unknown backend"):
        call()


def test_upstream_private_helpers_exist(monkeypatch):
    monkeypatch.setenv("POPMESH_TEST_B", "b")
    monkeypatch.delenv("POPMESH_TEST_A", raising=False)
    assert gfn._first_env("POPMESH_TEST_A", "POPMESH_TEST_B") == "b"
    assert gfn._first_env("POPMESH_TEST_A", default="d") == "d"
    pytest.importorskip("mpi4py")
    assert gfn._get_MPI().__name__ == "mpi4py.MPI"


# Upstream's single-process suites: a gloo process group of one that the test itself creates
# (TestTorchBackendSingleProcess), and mpi4py's COMM_WORLD of one (TestMPI4pyBackendSingleProcess).
# Every collective is the identity. Run in a fresh interpreter: the facade starts a popmesh world there.
SINGLE_PROCESS = """
import torch, torch.distributed as dist
from popmesh.compat.gfn import all_gather, all_reduce, barrier, broadcast, get_rank, get_world_size
dist.init_process_group(backend="gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
for backend in ("torch", "mpi"):
    assert get_rank(backend=backend) == 0 and get_world_size(backend=backend) == 1
    barrier(backend=backend)
    for op, data in (("SUM", [3.0, 4.0]), ("MAX", [1.0, 5.0, 3.0]), ("MIN", [1.0, 5.0, 3.0])):
        t = torch.tensor(data)
        all_reduce(t, op=op, backend=backend)
        assert t.tolist() == data, (backend, op, t)
    output = [torch.zeros(2)]
    all_gather(output, torch.tensor([1.0, 2.0]), backend=backend)
    assert output[0].tolist() == [1.0, 2.0]
    t = torch.tensor([7.0, 8.0])
    broadcast(t, src=0, backend=backend)
    assert t.tolist() == [7.0, 8.0]
dist.destroy_process_group()
print("UPSTREAM-SINGLE-PROCESS-OK")
"""


@pytest.mark.timeout(120)
def test_upstream_single_process_suites():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "POPMESH_ENGINE", "PMI_RANK", "PMI_SIZE")}
    done = subprocess.run([sys.executable, "-c", SINGLE_PROCESS.format(port=port)], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0 and "UPSTREAM-SINGLE-PROCESS-OK" in done.stdout, done.stdout + done.stderr


def test_a_host_with_cuda_gets_nccl_for_cuda_tensors_and_the_gfn_facade_asks_for_pure_gloo():
    """The device-dependent choices, for a host described as having CUDA (no GPU needed to check them)."""
    from types import SimpleNamespace

    from popmesh.compat import gfn
    from popmesh.core.errors import ConfigError
    from popmesh.engines.torch.engine import backend_for_host

    assert backend_for_host(cuda_available=True, nccl_available=True) == "cpu:gloo,cuda:nccl"
    assert backend_for_host(cuda_available=True, nccl_available=False) == "gloo"
    assert backend_for_host(cuda_available=False, nccl_available=True) == "gloo"
    assert gfn._world_options("gloo") == {"backend": "gloo"}  # torchgfn's buffers insist on exactly "gloo"
    assert gfn._world_options("mpi") == {}
    mixed = SimpleNamespace(engine_name="torch", engine=SimpleNamespace(backend="cpu:gloo,cuda:nccl"))
    with pytest.raises(ConfigError, match=r"insist on exactly 'gloo'.*popmesh.init\(backend='gloo'\)"):
        gfn._check_buffer_backend(mixed, num_remote_buffers=1)
    gfn._check_buffer_backend(mixed, num_remote_buffers=0)  # no buffer, no constraint
    gfn._check_buffer_backend(SimpleNamespace(engine_name="torch", engine=SimpleNamespace(backend="gloo")), 2)
