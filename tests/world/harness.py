"""Launch a real world for a test: N local processes on torch/gloo (loopback) or under mpiexec.

Each worker runs its registered checks in order (see ``worldlib``) and writes one JSON result file
per rank. The whole world has a hard timeout; on expiry every process group is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class WorldRun:
    engine: str
    size: int
    returncodes: list[int]
    output: str
    results: dict[int, dict[str, str]] = field(default_factory=dict)
    timed_out: bool = False

    def outcome(self, name: str) -> dict[int, str]:
        """Each rank's outcome of one check ("ok" or the error text; "missing" if it never ran)."""
        return {r: self.results.get(r, {}).get(name, "missing") for r in range(self.size)}


def mpiexec() -> str | None:
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else shutil.which("mpiexec")


def _base_env(out_dir: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE", "PMI_RANK",
                 "PMI_SIZE", "POPMESH_STORE_FD"):
        env.pop(name, None)
    env.update({"POPMESH_TEST_OUT": out_dir, "OMP_NUM_THREADS": "1", "POPMESH_TIMEOUT": "30",
                "PYTHONPATH": str(ROOT / "tests" / "world") + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


def _spawn_torch(script: Path, size: int, env: dict[str, str]) -> list[subprocess.Popen]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(size + 8)
    port = listener.getsockname()[1]
    procs = []
    for rank in range(size):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        POPMESH_ENGINE="torch")
        fds: tuple[int, ...] = ()
        if rank == 0:
            rank_env["POPMESH_STORE_FD"] = str(listener.fileno())
            fds = (listener.fileno(),)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=rank_env, pass_fds=fds,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    listener.close()
    return procs


def _spawn_mpi(script: Path, size: int, env: dict[str, str]) -> list[subprocess.Popen]:
    exe = mpiexec()
    if exe is None:
        raise RuntimeError("mpiexec not found: pip install mpi4py mpich")
    cmd = [exe, "-n", str(size), sys.executable, str(script)]
    return [subprocess.Popen(cmd, env=dict(env, POPMESH_ENGINE="mpi"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)]


def run_world(script: str | Path, engine: str, size: int, timeout: float = 120,
              env: dict[str, str] | None = None) -> WorldRun:
    """Run ``script`` on ``size`` ranks of ``engine`` (torch, mpi or local) and collect results."""
    out_dir = tempfile.mkdtemp(prefix="popmesh-test-")
    path = Path(script)
    base = _base_env(out_dir, env)
    if engine == "mpi":
        procs = _spawn_mpi(path, size, base)
    elif engine == "torch":
        procs = _spawn_torch(path, size, base)
    else:
        procs = [subprocess.Popen([sys.executable, str(path)], env=dict(base, POPMESH_ENGINE="local"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)]
    output, timed_out = _wait_all(procs, timeout)
    run = WorldRun(engine, size, [p.returncode for p in procs], output, timed_out=timed_out)
    for rank in range(size):
        f = Path(out_dir) / f"rank{rank}.json"
        if f.exists():
            run.results[rank] = json.loads(f.read_text())
    shutil.rmtree(out_dir, ignore_errors=True)
    return run


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[str, bool]:
    deadline = time.monotonic() + timeout
    outputs = []
    timed_out = False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_all(procs)
            out, _ = p.communicate()
        outputs.append(out.decode(errors="replace"))
    kill_all(procs)
    return "\n".join(outputs), timed_out


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
