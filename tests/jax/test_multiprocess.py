"""Multi-process JAX through the launcher: 2 processes x 4 CPU devices, gloo collectives."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from popmesh.core.errors import ConfigError

WORKER = Path(__file__).parent / "workers" / "multiprocess_worker.py"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("preload", [(), ("--preload", "jax,numpy")], ids=["started", "forked"])
def test_two_processes_four_devices_each(tmp_path, preload):
    """Also with the processes forked from a fork server that imported jax (popmesh launch --preload)."""
    env = dict(os.environ, POPMESH_TEST_OUT=str(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "2", "--engine", "jax", *preload, str(WORKER)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    results = {p.name: p.read_text() for p in tmp_path.glob("process*.txt")}
    assert results == {"process0.txt": "ok", "process1.txt": "ok"}, (results, done.stderr[-3000:])
    assert done.returncode == 0


def test_jax_env_validation():
    from popmesh.jax import read_jax_env

    assert not read_jax_env({}).distributed
    process = read_jax_env({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert process.distributed and process.process_id == 1
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
        read_jax_env({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    with pytest.raises(ConfigError, match="not set"):
        read_jax_env({"JAX_NUM_PROCESSES": "2"})
