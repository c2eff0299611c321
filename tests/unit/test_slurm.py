"""Slurm's variables, read as srun sets them (pure: no Slurm needed)."""

import pytest

from popmesh.core.errors import ConfigError
from popmesh.core.launch_env import detect_engine, launcher_world_size, read_torch_env
from popmesh.core.slurm import PORT_BASE, PORT_SPAN, expand_hostlist, read_slurm, tasks_per_node
from popmesh.launch.info import detected_launch


def task_env(rank=1, ntasks=4, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_ID": "0", "SLURM_NODEID": str(rank // 2),
           "SLURM_LOCALID": str(rank % 2), "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_JOB_ID": "123456",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    env.update(extra)
    return env


@pytest.mark.parametrize("spec,hosts", [
    ("login", ["login"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[08-10,12],login2", ["gpu08", "gpu09", "gpu10", "gpu12", "login2"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("a[7],b-[001-002]x", ["a7", "b-001x", "b-002x"]),
])
def test_hostlists_expand_as_slurm_writes_them(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]"])
def test_bad_hostlists_are_config_errors(spec):
    with pytest.raises(ConfigError, match="node list"):
        expand_hostlist(spec)


def test_tasks_per_node_syntax():
    assert [tasks_per_node("2(x3),1", i) for i in range(5)] == [2, 2, 2, 1, None]
    assert tasks_per_node("garbage", 0) is None


def test_a_task_of_a_step_reads_its_place_and_its_master():
    task = read_slurm(task_env(rank=3))
    assert task is not None
    assert (task.rank, task.world_size, task.local_rank, task.local_world_size, task.node_rank) == (3, 4, 1, 2, 1)
    assert task.nodes == ("gpu08", "gpu09") and task.master_addr == "gpu08"
    assert task.master_port == PORT_BASE + 123456 % PORT_SPAN
    variables = task.torch_variables(task_env(rank=3))
    assert variables == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                         "MASTER_ADDR": "gpu08", "MASTER_PORT": str(PORT_BASE + 123456 % PORT_SPAN)}
    kept = task.torch_variables({"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})
    assert (kept["MASTER_ADDR"], kept["MASTER_PORT"]) == ("10.0.0.7", "29500"), "the user's MASTER_* win"


def test_not_a_task_outside_a_step():
    assert read_slurm({}) is None
    batch_script = task_env()
    del batch_script["SLURM_STEP_ID"]
    assert read_slurm(batch_script) is None, "an sbatch script's own process is no task of a step"
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        read_slurm(task_env(rank=7))


def test_srun_tasks_form_a_torch_world_and_explicit_variables_win():
    env = task_env(rank=2)
    assert detect_engine(env) == "torch"
    torch_env = read_torch_env(env)
    assert (torch_env.rank, torch_env.world_size, torch_env.local_rank, torch_env.master_addr) == (2, 4, 0, "gpu08")
    assert torch_env.master_port == PORT_BASE + 123456 % PORT_SPAN
    with_torchrun = {**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}
    assert read_torch_env(with_torchrun).world_size == 1, "a launcher's RANK/WORLD_SIZE inside srun win"
    assert detect_engine({**env, "PMI_RANK": "2", "PMI_SIZE": "4"}) == "mpi", "srun --mpi=pmi2 starts MPI"


def test_launchers_announce_the_world_size():
    assert launcher_world_size({}) is None
    assert launcher_world_size({"PMI_SIZE": "3"}) == ("PMI_SIZE", 3)
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "2"}) == ("OMPI_COMM_WORLD_SIZE", 2)
    assert launcher_world_size(task_env()) == ("SLURM_NTASKS", 4)


def test_popmesh_info_says_what_it_detected():
    slurm = detected_launch(task_env(rank=1))
    assert slurm["launcher"] == "slurm (srun)" and slurm["engine"] == "torch" and slurm["nodes"] == "gpu08,gpu09"
    assert slurm["master"] == f"gpu08:{PORT_BASE + 123456 % PORT_SPAN}"
    assert detected_launch({})["launcher"].startswith("none") and detected_launch({})["engine"] == "local"
    assert "MPI" in detected_launch({"PMI_SIZE": "2", "PMI_RANK": "0"})["launcher"]
    assert detected_launch({"RANK": "0"})["engine"].startswith("none: RANK is set")
