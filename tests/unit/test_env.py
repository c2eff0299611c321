"""Reading the distributed environment: engine detection and validation (pure)."""

import math
from fractions import Fraction

import numpy as np
import pytest

import popmesh
from popmesh.core.errors import ConfigError
from popmesh.core.launch_env import detect_engine, read_check, read_timeout, read_torch_env
from popmesh.core.timeouts import check_timeout, resolve_timeout


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


@pytest.mark.parametrize(("environ", "message"), [
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not: set WORLD_SIZE as well"),
    ({"WORLD_SIZE": "4", "MASTER_PORT": "29500"}, "WORLD_SIZE is set but RANK is not: set RANK as well"),
])
def test_half_a_launch_is_refused_not_a_world_of_one(environ, message):
    with pytest.raises(ConfigError, match=message):
        detect_engine(environ)
    assert detect_engine({**environ, "POPMESH_ENGINE": "local"}) == "local"  # named explicitly: as asked


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
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a TCP port"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "integer from 1 to 65535"),  # a world of one too
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a TCP port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT='0' is not a TCP port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
         "LOCAL_RANK"),
    ],
)
def test_torch_env_errors(environ, message):
    with pytest.raises(ConfigError, match=message):
        read_torch_env(environ)


def test_world_of_one_without_master_port_and_init_with_a_bad_one(monkeypatch):
    assert read_torch_env({"RANK": "0", "WORLD_SIZE": "1"}).master_port == 0
    popmesh.finalize()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999", "POPMESH_ENGINE": "torch"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="MASTER_PORT='99999' is not a TCP port"):  # was torch's TypeError
        popmesh.init()


def test_timeout_and_check():
    assert read_timeout({}) == 300.0
    assert read_timeout({"POPMESH_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ConfigError):
            read_timeout({"POPMESH_TIMEOUT": bad})
    assert read_check({"POPMESH_CHECK": "1"}) and not read_check({})


@pytest.mark.parametrize("bad", ["1", b"1", True, False, 0, -1, -0.5, math.nan, math.inf, None, [1], np.bool_(True)])
def test_check_timeout_refuses_what_is_not_a_positive_number_of_seconds(bad):
    with pytest.raises(ConfigError, match=r"all_reduce: idle_timeout=.* (must be a number|must be a positive)"):
        check_timeout(bad, "idle_timeout", "all_reduce")


def test_check_timeout_accepts_real_numbers():
    assert [check_timeout(v) for v in (1, 2.5, np.float32(0.5), np.int64(3), Fraction(1, 4))] == [1.0, 2.5, 0.5, 3.0,
                                                                                                    0.25]
    assert resolve_timeout(None, 7.0) == 7.0 and resolve_timeout(2, 7.0) == 2.0


def test_every_public_timeout_goes_through_the_check():
    popmesh.finalize()
    world = popmesh.init("local")
    try:
        calls = [lambda: popmesh.all_reduce(1.0, timeout="1"), lambda: popmesh.barrier(timeout=math.nan),
                 lambda: popmesh.broadcast(1, timeout=True), lambda: popmesh.all_gather_object(1, timeout=-1),
                 lambda: popmesh.all_reduce_async(np.ones(1)).wait(timeout="1"),
                 lambda: popmesh.init("local", timeout="1")]
        for call in calls:
            with pytest.raises(ConfigError, match="timeout="):
                call()
        from popmesh.buffers import Coordinator, ReplayBufferClient, ReplayBufferManager

        for make in (lambda: ReplayBufferClient(0, timeout="5"), lambda: ReplayBufferManager([0], timeout="5"),
                     lambda: Coordinator([0], timeout="5"), lambda: ReplayBufferManager([0]).run(idle_timeout="5")):
            with pytest.raises(ConfigError, match="timeout='5' must be a number of seconds"):
                make()
    finally:
        world.finalize()


def test_the_restart_count_is_the_launchers_and_zero_in_a_first_life():
    from popmesh.core.launch_env import restart_count

    assert restart_count({}) == 0 and restart_count({"TORCHELASTIC_RESTART_COUNT": ""}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT='x' is not an integer"):
        restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})
    with pytest.raises(ConfigError, match="negative"):
        restart_count({"TORCHELASTIC_RESTART_COUNT": "-1"})


def test_a_world_is_elastic_only_when_popmesh_launch_gave_it_min_nodes_on_the_torch_engine():
    from popmesh.core.launch_env import launcher_elastic

    assert launcher_elastic({"POPMESH_MIN_NODES": "2", "POPMESH_ENGINE": "torch"})
    assert not launcher_elastic({"POPMESH_MIN_NODES": "2", "POPMESH_ENGINE": "mpi"})
    assert not launcher_elastic({"POPMESH_ENGINE": "torch"})
    assert not launcher_elastic({"POPMESH_MIN_NODES": "", "POPMESH_ENGINE": "torch"})
