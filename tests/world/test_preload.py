"""``popmesh launch --preload MODULES``: ranks forked from a fork server that imported the modules once.

A forked rank must be indistinguishable from a started one for the script and the launcher: its own
variables, argv, folder and session, fresh random states, the launcher as its parent (so teardown,
root causes and restarts work unchanged), python's exit rules (threads joined, atexit hooks run, a
text exit printed), and nothing left behind: no fork server, no zombie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from popmesh.launch.api import BOOTSTRAP

pytestmark = pytest.mark.world
SCRIPT = str(Path(__file__).parent / "scripts" / "preload_rank.py")


def _launch(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "popmesh", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "POPMESH_TIMEOUT": "30"})


def _reports(out: Path) -> dict[int, dict[str, object]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def _leftovers(launcher_pid: int) -> list[str]:
    """Processes whose parent was the launcher, or fork servers of it, still there after it exited."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "popmesh.launch.forkserver" in cmdline and f" {launcher_pid} " in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.timeout(90)
def test_forked_ranks_form_a_world_each_with_its_own_rank_argv_folder_and_random_state(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _launch("-n", "3", "--preload", "torch,numpy", SCRIPT, str(out), "report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(out)
    assert sorted(reports) == [0, 1, 2], done.stderr[-3000:]
    for rank, report in reports.items():
        assert report["size"] == 3 and report["env_rank"] == str(rank) and report["total"] == 6.0
        assert report["argv"] == [SCRIPT, str(out), "report"] and report["cwd"] == str(tmp_path)
        assert report["orig_argv"] == [sys.executable, "-P", BOOTSTRAP, "--", SCRIPT, str(out), "report"], \
            "the command line a started rank has (popmesh.launch.fork() re-executes it), not the fork server's"
        assert report["pgid"] == report["pid"], "each rank leads its own session, as a started one does"
        assert report["torch_preloaded"] is True
    launchers = {r["ppid"] for r in reports.values()}
    assert len(launchers) == 1, "every forked rank is adopted by the launcher"
    assert len({r["random"] for r in reports.values()}) == 3, "python's random state differs per rank"
    assert len({r["numpy"] for r in reports.values()}) == 3, "numpy's global random state differs per rank"
    assert _leftovers(launchers.pop()) == []


@pytest.mark.timeout(90)
def test_a_killed_forked_rank_is_named_and_restarted_by_forking_again(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _launch("-n", "3", "--preload", "torch", "--max-restarts", "1", SCRIPT, str(out), "kill-1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr and "restarted (1 of 1)" in done.stderr, done.stderr
    reports = _reports(out)
    assert {r: (v["total"], v["restarts"]) for r, v in reports.items()} == {0: (6.0, 0), 1: (6.0, 1), 2: (6.0, 0)}


@pytest.mark.timeout(90)
def test_without_restarts_a_killed_forked_rank_tears_the_world_down_naming_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _launch("-n", "3", "--preload", "torch", SCRIPT, str(out), "kill-1")
    assert done.returncode == 137, done.stderr[-3000:]
    assert "root cause: rank 1 was killed by SIGKILL" in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_forked_rank_exits_by_python_s_rules(tmp_path):
    """Non-daemon threads and executor workers are waited for, then atexit hooks run; a text given to
    sys.exit is printed and the status is 1."""
    done = _launch("-n", "1", "--preload", "numpy", SCRIPT, str(tmp_path), "threads")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "THREAD" in line or "ATEXIT" in line]
    assert lines == ["[rank 0] THREAD done", "[rank 0] ATEXIT after the thread"], done.stdout
    failed = _launch("-n", "1", "--preload", "numpy", SCRIPT, str(tmp_path), "exit-message")
    assert failed.returncode == 1 and "leaving with a message" in failed.stderr, failed.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("preload,expected", [
    ("no_such_module_xyz", "failed to import them: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("torch,9bad", "'9bad' is not a module name"),
])
def test_a_preload_that_cannot_be_imported_is_a_clear_error(tmp_path, preload, expected):
    done = _launch("-n", "2", "--preload", preload, SCRIPT, str(tmp_path), "report")
    assert done.returncode != 0 and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr.split(expected)[0][-200:]


@pytest.mark.timeout(30)
def test_mpi_ranks_cannot_be_forked_and_the_launcher_says_so(tmp_path):
    done = _launch("-n", "2", "--engine", "mpi", "--preload", "torch", SCRIPT, str(tmp_path), "report")
    assert done.returncode != 0 and "mpiexec starts the MPI ranks" in done.stderr, done.stderr
