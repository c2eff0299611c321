"""Pure parts of the launcher's isolation: loopback pinning, the oversubscription warning, and the
names of the shared-memory segments a Hydra job leaves (checked against values seen on a real run)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from popmesh.launch.mpirun import mpi_command
from popmesh.launch.plan import (
    LOOPBACK_VARS,
    LaunchSpec,
    loopback_env,
    loopback_interface,
    oversubscription_warning,
)
from popmesh.launch.shm import SegmentSweep, fnv1a_32, glibc_first_rand, hydra_segment_names

pytestmark = pytest.mark.timeout(30)
MPI_VARS = {"UCX_NET_DEVICES", "FI_TCP_IFACE", "FI_SOCKETS_IFACE", "FI_UDP_IFACE"}


@given(nproc=st.integers(1, 4096), cpus=st.integers(1, 512))
def test_warns_exactly_when_ranks_exceed_cores(nproc: int, cpus: int) -> None:
    warning = oversubscription_warning(nproc, cpus)
    assert (warning is not None) == (nproc > cpus)


def test_the_warning_says_what_happens_and_what_to_do() -> None:
    warning = oversubscription_warning(1000, 2)
    assert warning is not None
    assert warning.startswith("popmesh launch: warning: 1000 ranks on this node but only 2 CPU cores available")
    assert "will oversubscribe" in warning and "-n 2" in warning and "--nnodes" in warning
    assert "only 1 CPU core available" in (oversubscription_warning(3, 1) or "")


def test_one_node_pins_each_engine_to_loopback() -> None:
    assert loopback_env({}, LaunchSpec(nproc=2), "lo") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert loopback_env({}, LaunchSpec(nproc=2, engine="mpi"), "lo") == dict.fromkeys(MPI_VARS, "lo")
    assert loopback_env({}, LaunchSpec(nproc=2, engine="jax"), "lo") == {}
    assert set(LOOPBACK_VARS["mpi"]) == MPI_VARS


def test_variables_the_user_set_win_and_several_nodes_pin_nothing() -> None:
    user = {"UCX_NET_DEVICES": "mlx5_0:1", "FI_TCP_IFACE": ""}
    pinned = loopback_env(user, LaunchSpec(nproc=2, engine="mpi"), "lo")
    assert pinned == {"FI_SOCKETS_IFACE": "lo", "FI_UDP_IFACE": "lo"}
    assert loopback_env({"GLOO_SOCKET_IFNAME": "eth1"}, LaunchSpec(nproc=2), "lo") == {}
    spec = LaunchSpec(nproc=2, nnodes=2, node_rank=0, master_port=29500)
    assert loopback_env({}, spec, "lo") == {}
    assert loopback_env({}, LaunchSpec(nproc=2), None) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux names its loopback lo")
def test_the_loopback_interface_is_found() -> None:
    assert loopback_interface() == "lo"


def test_hydra_is_given_the_interface_for_its_proxy() -> None:
    assert mpi_command("mpx", 2, ["py"], hydra=True, iface="lo") == [
        "mpx", "-n", "2", "-prepend-pattern", "[rank %r] ", "-iface", "lo", "py",
    ]
    assert mpi_command("mpx", 2, ["py"], hydra=False, iface="lo") == ["mpx", "-n", "2", "py"]


def test_fnv1a_and_glibc_rand_reference_values() -> None:
    assert fnv1a_32(b"") == 0x811C9DC5 and fnv1a_32(b"a") == 0xE40C292C
    assert glibc_first_rand(1) == 1804289383 and glibc_first_rand(0) == 1804289383  # srand(0) means srand(1)


@pytest.mark.skipif(ctypes.util.find_library("c") is None or not sys.platform.startswith("linux"), reason="glibc")
@given(seed=st.integers(0, 2**32 - 1))
def test_glibc_first_rand_matches_the_c_library(seed: int) -> None:
    libc = ctypes.CDLL(None)
    libc.srand(ctypes.c_uint(seed))
    assert glibc_first_rand(seed) == libc.rand()


def test_segment_names_match_a_real_hydra_job() -> None:
    # Seen on this machine (MPICH 5.0.2): `mpiexec -verbose` printed kvsname=kvs_12316_0_297823101_vm,
    # and the job created /dev/shm/mpich_shm_179b9b0e_0. 297823101 is glibc's first rand() for a seed
    # of that second.
    seeds = [s for s in range(1795576440, 1795576450) if glibc_first_rand(s) == 297823101]
    assert seeds, "no seed of that window gives the job's random number"
    names = hydra_segment_names(12316, seeds, "vm")
    assert "mpich_shm_179b9b0e_0" in names and "mpich_vci_179b9b0e_0" in names
    assert "mpich_shm_179b9b0e_0" not in hydra_segment_names(12317, seeds, "vm")


def test_the_sweep_removes_only_its_jobs_new_segments(tmp_path: Path) -> None:
    def ours() -> str:
        names = hydra_segment_names(4242, [int(sweep.started)], "host")
        return next(n for n in sorted(names) if n.startswith("mpich_shm_"))

    before = tmp_path / "mpich_shm_1_0"
    before.write_bytes(b"x")
    sweep = SegmentSweep(str(tmp_path))
    (tmp_path / ours()).write_bytes(b"left by the job")
    (tmp_path / "mpich_shm_deadbeef_0").write_bytes(b"another job")
    (tmp_path / "unrelated").write_bytes(b"not MPICH's")
    assert sweep.sweep(4243, "host") == []  # another mpiexec pid: not ours
    assert sweep.sweep(4242, "other-host") == []
    assert sweep.sweep(4242, "host") == [ours()]
    assert sorted(os.listdir(tmp_path)) == ["mpich_shm_1_0", "mpich_shm_deadbeef_0", "unrelated"]
    assert sweep.sweep(4242, "host") == []  # nothing left to do


def test_a_name_that_was_there_before_the_launch_is_kept(tmp_path: Path) -> None:
    pid = 77
    names = hydra_segment_names(pid, range(int(time.time()) - 1, int(time.time()) + 2), "h")
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    sweep = SegmentSweep(str(tmp_path))
    assert sweep.sweep(pid, "h") == []
    assert set(os.listdir(tmp_path)) == names
