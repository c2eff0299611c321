"""Launch a real world for a test: N local processes on torch/gloo (loopback) or under mpiexec.

Each worker runs its registered checks in order (see ``worldlib``) and keeps one JSON result file per
rank. The harness watches the world: as soon as one rank reports a failed check (or, unless deaths
are expected, a rank exits with an error) it kills every process group of the world, as torch's
MultiProcessTestCase does, so peers are not left waiting in a collective until their timeout. The
checks that did not run because of that are reported as such. The whole world also has a hard
timeout; on expiry every process group is killed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from popmesh.launch.api import BOOTSTRAP
from popmesh.launch.preload import ForkedProcess, ForkServer
from popmesh.launch.runner import reap_group
from ports import port_of, store_env, store_listener
from worldlib import SKIPPED

ROOT = Path(__file__).resolve().parents[2]
MISSING, NOT_RUN, TAKEN_DOWN = "missing", "not run", "taken down while running it"
POLL_S = 0.05
ABORT_GRACE_S = 0.3  # after the first failure, for ranks failing the same check at the same moment


@dataclass(frozen=True)
class Abort:
    """Why the harness took a world down: ``rank`` failed (or died in) ``check``."""

    rank: int
    check: str | None
    error: str

    def reason(self) -> str:
        what = f"check {self.check} failed on rank {self.rank}" if self.check else f"rank {self.rank} failed"
        return f"the world was taken down after {what}: {self.error.splitlines()[0]}"


@dataclass
class WorldRun:
    engine: str
    size: int
    returncodes: list[int]
    output: str
    results: dict[int, dict[str, str]] = field(default_factory=dict)
    running: dict[int, str | None] = field(default_factory=dict)  # the check each rank was in when it ended
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)  # each rank's time per check
    timed_out: bool = False
    aborted: Abort | None = None

    def outcome(self, name: str) -> dict[int, str]:
        """Each rank's outcome of one check: "ok", "skipped: why", the error text, or one of
        TAKEN_DOWN, NOT_RUN (the world was taken down before or while it ran) or MISSING (no report)."""
        return {r: self._outcome(r, name) for r in range(self.size)}

    def _outcome(self, rank: int, name: str) -> str:
        if name in self.results.get(rank, {}):
            return self.results[rank][name]
        abort = self.aborted
        if abort is None or abort.check is None:  # nothing ran, or a rank died outside any check
            return MISSING
        if abort.rank == rank and abort.check == name:
            return abort.error
        return TAKEN_DOWN if self.running.get(rank) == name else NOT_RUN

    def verdict(self, name: str) -> tuple[str, str]:
        """("pass" | "skip" | "fail", why) of one check over every rank."""
        outcomes = self.outcome(name)
        text = "; ".join(f"rank {r}: {o}" for r, o in outcomes.items() if o != "ok")
        errors = [o for o in outcomes.values() if o not in ("ok", NOT_RUN, TAKEN_DOWN) and not o.startswith(SKIPPED)]
        if errors:
            return "fail", f"{name} on {self.engine}-{self.size}: {text}"
        if any(o in (NOT_RUN, TAKEN_DOWN) for o in outcomes.values()):
            return "skip", f"not run: {self.aborted.reason()}"
        if all(o.startswith(SKIPPED) for o in outcomes.values()):
            return "skip", outcomes[0]
        return "pass", ""


def mpiexec() -> str | None:
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else shutil.which("mpiexec")


def _base_env(out_dir: str, extra: dict[str, str] | None, fail_fast: bool) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE", "PMI_RANK",
                 "PMI_SIZE", "POPMESH_STORE_FD"):
        env.pop(name, None)
    env.update({"POPMESH_TEST_OUT": out_dir, "OMP_NUM_THREADS": "1", "POPMESH_TIMEOUT": "30",
                "POPMESH_TEST_FAIL_FAST": "1" if fail_fast else "0",
                "PYTHONPATH": str(ROOT / "tests" / "world") + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


Proc = subprocess.Popen | ForkedProcess

# Torch worlds' ranks are forked from one server that imported these for the whole session (popmesh
# launch --preload): a rank then starts in milliseconds instead of importing torch for 1.5-2 s of CPU.
PRELOAD = ("torch", "numpy")
_forks: list[ForkServer] = []


def _fork_server() -> ForkServer:
    if not _forks:
        env = {k: v for k, v in _base_env("", None, True).items() if not k.startswith("POPMESH_TEST_")}
        _forks.append(ForkServer([sys.executable], BOOTSTRAP, PRELOAD, env))
        atexit.register(_forks[0].close)
    return _forks[0]


def _fork(script: Path, env: dict[str, str], log: Path, fds: tuple[int, ...] = ()) -> ForkedProcess:
    """Fork one rank running ``script`` (as ``python script`` would) in a session of its own, output in ``log``."""
    with open(log, "wb") as out:
        return _fork_server().popen([sys.executable, "-P", BOOTSTRAP, "--", str(script)], env,
                                    stdin=subprocess.DEVNULL, stdout=out.fileno(), stderr=subprocess.STDOUT,
                                    pass_fds=fds)


def _popen(cmd: list[str], env: dict[str, str], log: Path, fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start one process in a session of its own, its output in ``log`` (a pipe nobody reads would fill)."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, pass_fds=fds, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _spawn_torch(script: Path, size: int, env: dict[str, str], logs: Path) -> list[Proc]:
    procs = []
    with store_listener(size + 8) as listener:  # rank 0's store socket; closed here once it holds it
        for rank in range(size):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_of(listener)),
                            POPMESH_ENGINE="torch", **(store_env(listener) if rank == 0 else {}))
            fds = (listener.fileno(),) if rank == 0 else ()
            procs.append(_fork(script, rank_env, logs / f"out{rank}.log", fds))
    return procs


def _spawn_mpi(script: Path, size: int, env: dict[str, str], logs: Path) -> list[Proc]:
    exe = mpiexec()
    if exe is None:
        raise RuntimeError("mpiexec not found: pip install mpi4py mpich")
    cmd = [exe, "-n", str(size), sys.executable, str(script)]
    return [_popen(cmd, dict(env, POPMESH_ENGINE="mpi"), logs / "out0.log")]


def run_world(script: str | Path, engine: str, size: int, timeout: float = 120,
              env: dict[str, str] | None = None, *, fail_fast: bool = True,
              expect_deaths: bool = False) -> WorldRun:
    """Run ``script`` on ``size`` ranks of ``engine`` (torch, mpi or local) and collect results.

    ``fail_fast``: take the world down at the first failed check. ``expect_deaths``: a rank exiting
    with an error is part of the test (a crash scenario), not a reason to take the world down.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="popmesh-test-"))
    path = Path(script)
    base = _base_env(str(out_dir), env, fail_fast)
    if engine == "mpi":
        procs = _spawn_mpi(path, size, base, out_dir)
    elif engine == "torch":
        procs = _spawn_torch(path, size, base, out_dir)
    else:
        procs = [_popen([sys.executable, str(path)], dict(base, POPMESH_ENGINE="local"), out_dir / "out0.log")]
    try:
        # under mpiexec one process is the whole world, and mpiexec ends it when a rank dies
        deaths = fail_fast and not expect_deaths and engine != "mpi"
        timed_out, aborted = _watch(procs, out_dir, timeout, fail_fast, deaths)
    finally:
        kill_all(procs)
        for p in procs:
            p.wait()
            reap_group(p.pid)  # what a forked rank's group left to this process (the fork server's adopter)
    output = "\n".join((out_dir / f"out{i}.log").read_text(errors="replace") for i in range(len(procs)))
    run = WorldRun(engine, size, [p.returncode for p in procs], output, timed_out=timed_out, aborted=aborted)
    for rank in range(size):
        f = out_dir / f"rank{rank}.json"
        if f.exists():
            report = json.loads(f.read_text())
            run.results[rank], run.running[rank], run.seconds[rank] = (report["outcomes"], report["running"],
                                                                       report["seconds"])
    if aborted is not None:
        run.output += f"\n[harness] {aborted.reason()}\n"
    shutil.rmtree(out_dir, ignore_errors=True)
    return run


def _watch(procs: list[Proc], out_dir: Path, timeout: float, fail_fast: bool,
           deaths: bool) -> tuple[bool, Abort | None]:
    """Wait until every process ended, the world failed (then kill it) or ``timeout`` passed.
    ``deaths``: a rank process exiting with an error fails the world too. Returns (timed out, why
    the world was taken down). Result files are replaced atomically: they can be read any time."""
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while [p for p in procs if p.poll() is None]:  # polls every process: _died reads returncode
        now = time.monotonic()
        if now >= deadline:
            return True, None
        died = _died(procs) if deaths else None
        if died is not None:
            time.sleep(ABORT_GRACE_S)  # its own failure report may be on its way
        elif fail_fast and first_failure is None and _markers(out_dir):
            first_failure = now
        if died is not None or (first_failure is not None and now - first_failure >= ABORT_GRACE_S):
            kill_all(procs)
            return False, _root_cause(out_dir, procs, deaths)
        time.sleep(POLL_S)
    return False, _root_cause(out_dir, procs, deaths) if fail_fast else None


def _root_cause(out_dir: Path, procs: list[Proc], deaths: bool) -> Abort | None:
    """The first failure a rank reported (by the ranks' own clocks), unless a rank died first without
    reporting one (its peers' errors then follow from its death)."""
    died = _died(procs) if deaths else None
    reports = sorted(_reports(out_dir))
    if died is not None and died[0] not in {rank for _, rank, _ in reports}:
        return _death(out_dir, *died)
    if not reports:
        return None
    _, rank, check = reports[0]
    outcomes = json.loads((out_dir / f"rank{rank}.json").read_text())["outcomes"]
    return Abort(rank, check, outcomes[check])


def _markers(out_dir: Path) -> list[str]:
    return [n for n in os.listdir(out_dir) if n.startswith("failed-rank")]


def _died(procs: list[Proc]) -> tuple[int, int] | None:
    """(rank, exit code) of a rank process that exited with an error (returncode as last polled)."""
    for rank, p in enumerate(procs):
        if p.returncode not in (None, 0):
            return rank, p.returncode
    return None


def _reports(out_dir: Path) -> list[tuple[float, int, str]]:
    """(time, rank, check) of every failure reported so far."""
    reports = []
    for name in _markers(out_dir):
        marker = json.loads((out_dir / name).read_text())
        reports.append((marker["at"], int(name.removeprefix("failed-rank")), marker["check"]))
    return reports


def _death(out_dir: Path, rank: int, code: int) -> Abort:
    f = out_dir / f"rank{rank}.json"
    running = json.loads(f.read_text())["running"] if f.exists() else None
    return Abort(rank, running, f"rank {rank} exited with code {code} without reporting (see its output)")


def kill_all(procs: list[Proc]) -> None:
    """Take the world down at once: every rank is stopped before any is killed. Killed one after the
    other, a rank still running can see its killed peers' connections close and report a PeerFailure
    of its own before its turn comes (on a loaded box), which reads as a second failure."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
