"""The pure parts of ``--preload``: the option, its checks and the environment the fork server imports under."""

from __future__ import annotations

import pytest

from popmesh.core.errors import ConfigError
from popmesh.launch.options import parse_preload
from popmesh.launch.plan import LaunchSpec, is_module_name, shared_env, validate


def test_the_option_is_a_comma_list_with_blanks_dropped():
    assert parse_preload("torch, numpy,,jax.numpy ") == ("torch", "numpy", "jax.numpy")
    assert parse_preload("") == ()


@pytest.mark.parametrize("name,ok", [("torch", True), ("jax.numpy", True), ("_x.y1", True),
                                     ("9bad", False), ("torch.", False), ("a-b", False), ("", False)])
def test_module_names(name, ok):
    assert is_module_name(name) is ok


def test_the_server_imports_under_the_variables_every_rank_shares():
    envs = [{"A": "1", "RANK": "0", "B": "x"}, {"A": "1", "RANK": "1", "B": "x"}, {"A": "1", "RANK": "2"}]
    assert shared_env(envs) == {"A": "1"}
    assert shared_env([{"A": "1"}]) == {"A": "1"}
    assert shared_env([]) == {}


def test_preload_is_refused_where_the_launcher_does_not_start_the_ranks():
    with pytest.raises(ConfigError, match="mpiexec starts the MPI ranks"):
        validate(LaunchSpec(nproc=2, engine="mpi", preload=("torch",)))
    with pytest.raises(ConfigError, match=r"'torch\.' is not a module name"):
        validate(LaunchSpec(nproc=2, preload=("torch.",)))
    validate(LaunchSpec(nproc=2, engine="jax", preload=("jax",)))
    validate(LaunchSpec(nproc=2, preload=("torch", "numpy")))
