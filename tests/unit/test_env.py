"""Reading the distributed environment: engine detection and validation (pure)."""

import pytest

from popmesh.core.errors import ConfigError
from popmesh.core.launch_env import detect_engine, read_check, read_timeout, read_torch_env


@pytest.mark.parametrize(
    "environ, engine",
    [
        ({}, "local"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "mpi"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "torch"),
        ({"POPMESH_ENGINE": "mpi", "RANK": "0", "WORLD_SIZE": "2"}, "mpi"),
        ({"POPMESH_ENGINE": "jax"}, "local"),
    ],
)
def test_detect_engine(environ, engine):
    assert detect_engine(environ) == engine


def test_unknown_engine_variable():
    with pytest.raises(ConfigError, match="POPMESH_ENGINE"):
        detect_engine({"POPMESH_ENGINE": "horovod"})


def test_torch_env_valid():
    env = read_torch_env({"RANK": "1", "WORLD_SIZE": "3", "MASTER_PORT": "1234", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "3", "POPMESH_STORE_FD": "7"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.store_fd) == (1, 3, "127.0.0.1", 1234, 7)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "1"}, "WORLD_SIZE=0"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
        ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK=-1"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "not an integer"),
        ({"WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "not a valid TCP port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
         "LOCAL_RANK"),
    ],
)
def test_torch_env_errors(environ, message):
    with pytest.raises(ConfigError, match=message):
        read_torch_env(environ)


def test_timeout_and_check():
    assert read_timeout({}) == 300.0
    assert read_timeout({"POPMESH_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError):
            read_timeout({"POPMESH_TIMEOUT": bad})
    assert read_check({"POPMESH_CHECK": "1"}) and not read_check({})
