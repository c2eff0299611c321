"""What a one-node world launched by ``popmesh launch`` exposes and leaves behind, with real processes.

* Listening sockets: every socket the launcher's process tree listens on (TCP) or receives on (UDP)
  is on loopback, except Hydra's control socket, which Hydra binds to the wildcard address whatever
  its options (docs/launcher.md, "What listens where").
* MPICH's shared memory: a world with a killed or failing rank leaves none of its ``mpich_*``
  segments in /dev/shm, and a concurrent segment of another job stays.
* More ranks than the launcher's cores: one warning on stderr.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from popmesh.launch.plan import loopback_interface

pytestmark = pytest.mark.world
SCRIPTS = Path(__file__).parent / "scripts"
WORKER = str(SCRIPTS / "launch_isolation_worker.py")
HAS_MPI = importlib.util.find_spec("mpi4py") is not None and os.access(Path(sys.executable).parent / "mpiexec", os.X_OK)
ENGINES = ["torch", pytest.param("mpi", marks=[pytest.mark.mpi, pytest.mark.skipif(not HAS_MPI, reason="MPI")])]
_TCP_LISTEN, _UDP_UNCONNECTED = "0A", "07"


@dataclass(frozen=True)
class Listener:
    pid: int
    comm: str
    proto: str
    address: str
    port: int
    inode: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """``root`` and its live descendants: pid -> (parent pid, command name)."""
    procs = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        head, rest = stat.rsplit(")", 1)
        procs[int(entry)] = (int(rest.split()[1]), head.split("(", 1)[1])
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = procs.get(pid, (0, "?"))
        todo.extend(p for p, (ppid, _) in procs.items() if ppid == pid)
    return tree


def _socket_table(pid: int) -> dict[int, tuple[str, str, int]]:
    """Listening TCP and unconnected UDP sockets of ``pid``'s network namespace: inode -> (proto, ip, port)."""
    table = {}
    for proto, wanted in (("tcp", _TCP_LISTEN), ("tcp6", _TCP_LISTEN), ("udp", _UDP_UNCONNECTED),
                          ("udp6", _UDP_UNCONNECTED)):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != wanted:
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            if proto.endswith("6"):
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            else:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            table[int(fields[9])] = (proto, ip, int(hex_port, 16))
    return table


def listeners(root: int) -> list[Listener]:
    """Every listening socket held by a process of ``root``'s tree (a shared socket once per holder)."""
    table = _socket_table(root)
    found = []
    for pid, (_, comm) in process_tree(root).items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = int(target[8:-1]) if target.startswith("socket:[") else -1
            if inode in table:
                found.append(Listener(pid, comm, *table[inode], inode))
    return found


def start(engine: str, mode: str, piddir: Path, n: int = 2) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "popmesh", "launch", "-n", str(n), "--engine", engine, WORKER, mode],
        env={**os.environ, "POPMESH_TEST_PIDDIR": str(piddir)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def wait_ready(piddir: Path, n: int, launcher: subprocess.Popen[str], timeout: float = 40) -> list[dict]:
    """Each rank's report, once all ``n`` have written one."""
    deadline = time.monotonic() + timeout
    while len(list(piddir.glob("*.json"))) < n:
        if launcher.poll() is not None or time.monotonic() > deadline:
            out, err = launcher.communicate()
            pytest.fail(f"the world did not come up (exit {launcher.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
        time.sleep(0.05)
    return [json.loads((piddir / f"{r}.json").read_text()) for r in range(n)]


def finish(launcher: subprocess.Popen[str], piddir: Path) -> tuple[str, str]:
    """Release the ranks and wait for the launcher; on a timeout kill it (it takes the ranks along)."""
    (piddir / "release").touch()
    try:
        return launcher.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGTERM)
        return launcher.communicate(timeout=15)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_one_node_world_listens_on_loopback_only(engine: str, piddir: Path) -> None:
    launcher = start(engine, "hold", piddir)
    try:
        ranks = wait_ready(piddir, 2, launcher)
        socks = listeners(launcher.pid)
        tree = process_tree(launcher.pid)
    finally:
        _, err = finish(launcher, piddir)
    assert launcher.returncode == 0, err[-3000:]
    rank_pids = {r["pid"] for r in ranks}
    # Hydra's control socket (held by mpiexec, inherited by its proxy and the ranks) is bound to the
    # wildcard address; Hydra has no option that changes that. It is the one exception allowed.
    mpiexec = {pid for pid, (ppid, comm) in tree.items() if ppid == launcher.pid and comm.startswith("mpiexec")}
    hydra = {s.inode for s in socks if s.pid in mpiexec}
    assert len(hydra) <= 1, f"mpiexec listens on more than its control socket: {socks}"
    outside = [s for s in socks if s.inode not in hydra and not s.loopback]
    assert not outside, f"listening beyond loopback: {outside}"
    own = [s for s in socks if s.pid in rank_pids and s.inode not in hydra]
    assert own, f"the ranks hold no listening socket of their own, so the test saw the wrong processes: {socks}"
    if engine == "torch":
        assert {r["gloo_ifname"] for r in ranks} == {loopback_interface()}


@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.skipif(not HAS_MPI, reason="needs mpi4py and the venv's mpiexec")
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_a_failed_mpi_world_leaves_no_shared_memory(mode: str, piddir: Path) -> None:
    launcher = start("mpi", mode, piddir)
    other = Path("/dev/shm") / f"mpich_shm_{secrets.token_hex(4)}_0"  # named like MPICH's, made meanwhile
    try:
        ranks = wait_ready(piddir, 2, launcher)
        ours = {name for r in ranks for name in r["shm"]}
        other.write_bytes(b"another job's segment")
        _, err = finish(launcher, piddir)
        assert launcher.returncode != 0, f"the world was meant to fail: {err[-2000:]}"
        assert ours, "MPICH opened no shared-memory segment, so there was nothing to clean up"
        left = ours & set(os.listdir("/dev/shm"))
        assert not left, f"segments left after the failed world: {sorted(left)}"
        assert other.exists(), "the launcher removed a segment that is not its job's"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        other.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_more_ranks_than_cores_warns_once_on_stderr() -> None:
    one_core = {min(os.sched_getaffinity(0))}
    worker = str(SCRIPTS / "launch_worker.py")

    def run(n: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "popmesh", "launch", "-n", str(n), worker, "ok"], capture_output=True, text=True,
            timeout=50, preexec_fn=lambda: os.sched_setaffinity(0, one_core),
        )

    over = run(2)
    assert over.returncode == 0, over.stderr
    warnings = [line for line in over.stderr.splitlines() if line.startswith("popmesh launch: warning:")]
    assert len(warnings) == 1 and "2 ranks on this node but only 1 CPU core available" in warnings[0]
    assert "will oversubscribe" in warnings[0] and "-n 1" in warnings[0]
    fits = run(1)
    assert fits.returncode == 0 and "warning" not in fits.stderr
