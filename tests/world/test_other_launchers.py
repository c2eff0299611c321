"""Other launchers on real processes: tasks started with only srun's variables form one world; a
world whose MPI disagrees with its launcher's announced size is refused; under torchrun, popmesh
uses the agent's store."""

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness import mpiexec

SCRIPTS = Path(__file__).parent / "scripts"


def _srun_env(rank: int, ntasks: int, job: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "OMPI_", "POPMESH_ENGINE")) and k not in ("RANK", "WORLD_SIZE")}
    env.update({"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_ID": "0", "SLURM_NODEID": "0",
                "SLURM_LOCALID": str(rank), "SLURM_STEP_NODELIST": socket.gethostname(), "SLURM_JOB_ID": str(job),
                "SLURM_STEP_TASKS_PER_NODE": str(ntasks), "POPMESH_TIMEOUT": "60"})
    env.update(extra)
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("master", ["derived", "set"])
def test_srun_tasks_form_one_world(master):
    """Before: each task believed it was rank 0 of a world of one (no SLURM_* variable was read)."""
    job = random.randrange(1, 10**6)
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(20000 + job % 9000)} if master == "set" else {}
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "slurm_task.py")], env=_srun_env(r, 2, job, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, out[-3000:]
        assert f"TASK rank={rank} size=2 local={rank} sum=3.0" in out, out[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
def test_mpi_world_smaller_than_its_launcher_says_is_refused():
    """Open MPI's variables say 2, but this mpi4py's MPICH forms a singleton: ConfigError, not a silent world of one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_"))}
    env.update({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "POPMESH_ENGINE": "mpi"})
    done = subprocess.run([sys.executable, "-c", "import popmesh; popmesh.init()"], env=env, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode != 0
    assert "ConfigError" in done.stderr and "OMPI_COMM_WORLD_SIZE=2" in done.stderr, done.stderr[-2000:]
    assert "formed a world of 1" in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_under_torchrun_the_agent_store_is_used():
    """Before: rank 0 started a store server of its own, and every run logged 'failed to bind'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "POPMESH_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(SCRIPTS / "torchrun_task.py")], env=env, capture_output=True, text=True, timeout=100)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert all(f"TORCHRUN rank={r} size=2 sum=2.0" in output for r in range(2)), output[-3000:]
    assert "failed to bind" not in output, output[-3000:]


@pytest.mark.timeout(120)
def test_popmesh_launch_under_srun_takes_its_nodes_from_the_step():
    """`srun --ntasks-per-node=1 popmesh launch -n 2 script.py` on two "nodes": each launcher is a task
    of the step, which gives the node count, its node rank and the rendezvous (here both on this host)."""
    job = random.randrange(1, 10**6)
    script = SCRIPTS / "torchrun_task.py"  # prints its rank and the world size after an all_reduce
    procs = []
    for node in range(2):
        env = _srun_env(node, 2, job)
        env["SLURM_NODEID"], env["SLURM_LOCALID"] = str(node), "0"
        procs.append(subprocess.Popen([sys.executable, "-m", "popmesh", "launch", "-n", "2", str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    everything = "\n".join(outputs)
    assert all(f"TORCHRUN rank={r} size=4 sum=4.0" in everything for r in range(4)), everything[-3000:]
