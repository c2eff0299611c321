"""Worlds over two hosts: network namespaces joined by a veth pair, each with its own host name and
/etc/hosts (tests/world/hosts.py), one launcher per host for torch, one mpiexec over both for MPI.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2/util-linux).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import mpiexec
from hosts import TwoHosts, finish_launchers, unavailable

pytestmark = [pytest.mark.world, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
SCRIPT = str(Path(__file__).parent / "scripts" / "hosts_world.py")
_LINE = re.compile(r"HOST rank=(\d+) size=(\d+) host=(\S+) sum=(\S+)")
_STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE",
          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HYDRA_IFACE")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STALE and not k.startswith(("SLURM_", "PMI_"))}
    return {**env, "POPMESH_TIMEOUT": "60", **extra}


def _torch_nodes(th: TwoHosts, port: int, *script_args: str, **env: str) -> list[subprocess.Popen[str]]:
    """One `popmesh launch -n 2 --nnodes 2` per host, meeting at host a's address."""
    a = th.hosts[0]
    return [
        host.start([sys.executable, "-m", "popmesh", "launch", "-n", "2", "--nnodes", "2", "--node-rank", str(i),
                    "--master-addr", a.addr, "--master-port", str(port), SCRIPT, *script_args],
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(**env))
        for i, host in enumerate(th.hosts)
    ]


def _assert_world(outputs: str, th: TwoHosts) -> None:
    """Four ranks, two on each host (by their host names), each with the sum 1+2+3+4, and messages of
    4 B, 8 KB and 336 KB passed around the ring (from one host to the other at two of its hops)."""
    seen = {int(m[1]): (int(m[2]), m[3], m[4]) for m in _LINE.finditer(outputs)}
    a, b = th.hosts
    assert seen == {0: (4, a.name, "10"), 1: (4, a.name, "10"), 2: (4, b.name, "10"), 3: (4, b.name, "10")}, outputs
    assert sorted(int(r) for r in re.findall(r"RING rank=(\d) ok", outputs)) == [0, 1, 2, 3], outputs[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("names", TwoHosts.NAMES)
def test_a_torch_world_forms_across_two_hosts_whatever_their_names_resolve_to(names):
    """Before: when a host's own name resolved to 127.0.1.1, gloo listened there and the world never
    formed ('connectFullMesh failed ... 127.0.1.1'). The interface that routes to the master is pinned."""
    with TwoHosts(names=names) as th:
        ended = finish_launchers(_torch_nodes(th, 29610), timeout=90)
    assert [code for code, _ in ended] == [0, 0], "\n".join(out[-3000:] for _, out in ended)
    _assert_world("".join(out for _, out in ended), th)


@pytest.mark.timeout(120)
def test_an_unreachable_transport_address_fails_fast_naming_it_and_the_variable():
    """A user's GLOO_SOCKET_IFNAME=lo on two hosts: every rank fails within 15 s of the world meeting,
    naming the address it could not reach and what to set, instead of gloo's error minutes later."""
    with TwoHosts() as th:
        start = time.monotonic()
        ended = finish_launchers(_torch_nodes(th, 29611, GLOO_SOCKET_IFNAME="lo"), timeout=90)
        elapsed = time.monotonic() - start
    for code, out in ended:
        assert code != 0
        assert "could not reach rank" in out and "at 127.0.0.1:" in out, out[-3000:]
        assert "set GLOO_SOCKET_IFNAME on every host" in out and "GLOO_SOCKET_IFNAME=lo, set by the user" in out
    assert elapsed < 30, f"took {elapsed:.1f} s (start-up included)"


@pytest.mark.timeout(120)
def test_the_loss_of_a_host_ends_the_other_within_seconds_naming_ranks_and_host():
    with TwoHosts(names="unresolved") as th:
        procs = _torch_nodes(th, 29612, "hold")
        assert _wait_for_lines(procs[0], "HOLDING", 2, timeout=60)
        start = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)  # host b's launcher and its ranks
        (code, out), = finish_launchers(procs[:1], timeout=30)
        elapsed = time.monotonic() - start
        finish_launchers(procs[1:], timeout=10)
    assert code != 0
    cause = next(line for line in out.splitlines() if "root cause:" in line)
    assert "PeerFailure" in cause and "on host pmhostb" in cause and re.search(r"rank\(s\) \[[23]", cause), out[-3000:]
    assert elapsed < 10, f"host a's launcher ended {elapsed:.1f} s after host b was lost"


def _wait_for_lines(proc: subprocess.Popen[str], marker: str, count: int, timeout: float) -> bool:
    """Read ``proc``'s output until ``count`` lines contain ``marker`` (False at ``timeout`` or its end)."""
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout, 0
    while seen < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False
        seen += marker in line
    return seen >= count


@pytest.mark.timeout(120)
def test_tasks_started_as_srun_starts_them_form_one_world_over_two_hosts():
    """Only SLURM_* variables, two tasks a host; the step's first node hosts the rendezvous. Its name
    resolves to 127.0.1.1 on itself (Debian's line), to its address on the other host."""
    job = 4242 + os.getpid() % 1000
    with TwoHosts(names="own-loopback") as th:
        a, b = th.hosts
        procs = []
        for rank in range(4):
            node = rank // 2
            env = _env(SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_STEP_ID="0", SLURM_NODEID=str(node),
                       SLURM_LOCALID=str(rank % 2), SLURM_STEP_NODELIST=f"{a.name},{b.name}", SLURM_JOB_ID=str(job),
                       SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_NNODES="2")
            procs.append(th.hosts[node].start([sys.executable, SCRIPT], stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, env=env))
        ended = finish_launchers(procs, timeout=90)
    assert [code for code, _ in ended] == [0] * 4, "\n".join(out[-2000:] for _, out in ended)
    _assert_world("".join(out for _, out in ended), th)


@pytest.mark.timeout(120)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
@pytest.mark.parametrize("how", ["--hosts", "--hostfile"])
def test_popmesh_launch_runs_an_mpi_world_across_two_hosts(how, tmp_path):
    """One mpiexec on host a starts two ranks on each host; Hydra reaches host b through an ssh stand-in
    that runs its proxy in b's namespace. Host names resolve to 127.0.1.1 on themselves."""
    with TwoHosts(names="own-loopback") as th:
        a, b = th.hosts
        standin = th.ssh_standin(tmp_path / "ssh")
        if how == "--hosts":
            placement = ["--hosts", f"{a.name}:2,{b.name}:2"]
        else:
            (tmp_path / "hostfile").write_text(f"# two hosts\n{a.name} slots=2\n{b.name}:2\n")
            placement = ["--hostfile", str(tmp_path / "hostfile")]
        proc = a.start([sys.executable, "-m", "popmesh", "launch", "--engine", "mpi", *placement, SCRIPT],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                       env=_env(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(standin)))
        (code, out), = finish_launchers([proc], timeout=90)
    assert code == 0, out[-3000:]
    _assert_world(out, th)


@pytest.mark.timeout(120)
def test_a_rank_lost_on_one_host_is_restarted_there_and_the_world_reforms_across_hosts():
    """--max-restarts over two hosts: node 0's launcher serves the store, host b's launcher restarts its
    rank 3, and the four ranks finish in generation 1 with every sum right. Each host's launcher forks its
    ranks and the restart from a fork server of its own (--preload torch)."""
    survive = str(Path(__file__).parent / "scripts" / "survive.py")
    with TwoHosts(names="unresolved") as th:
        a = th.hosts[0]
        procs = [
            host.start([sys.executable, "-m", "popmesh", "launch", "-n", "2", "--nnodes", "2", "--node-rank", str(i),
                        "--master-addr", a.addr, "--master-port", "29613", "--max-restarts", "1", "--preload", "torch",
                        survive,
                        "120", "3", "50"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
            for i, host in enumerate(th.hosts)
        ]
        ended = finish_launchers(procs, timeout=100)
    out = "".join(text for _, text in ended)
    assert [code for code, _ in ended] == [0, 0], out[-4000:]
    done = re.findall(r"DONE rank=(\d) gen=(\d+) step=(\d+) good=(\w+) restart=(\d)", out)
    assert sorted(done) == [("0", "1", "120", "True", "0"), ("1", "1", "120", "True", "0"),
                            ("2", "1", "120", "True", "0"), ("3", "1", "120", "True", "1")], out[-4000:]
    assert "rank 3 was killed by SIGKILL" in ended[1][1] and "restarted (1 of 1)" in ended[1][1]
