"""``popmesh demo --nnodes MIN:MAX`` on loopback: a later launcher's ranks join the running population,
seeded from the best agents and then explored; a rank lost with no restart left leaves for good and the
others finish without it; below MIN nodes the run stops, saying why."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosts import finish_launchers
from popmesh.demo.config import ENT_RANGE, LR_RANGE

pytestmark = pytest.mark.world
_STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE",
          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RESTART_COUNT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo(nodes: str, node: int, ranks: int, endpoint: str, out: Path, *options: str) -> subprocess.Popen[str]:
    """One launcher of the run; every launcher gets the same options but its --node-rank."""
    argv = [sys.executable, "-m", "popmesh", "demo", "--nnodes", nodes, "--node-rank", str(node), "--ranks",
            str(ranks), "--rdzv-endpoint", endpoint, "--every", "2", "--warmup", "0", "--no-live", "--out", str(out),
            *options]
    env = {k: v for k, v in os.environ.items() if k not in _STALE and not k.startswith(("SLURM_", "PMI_"))}
    return subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**env, "POPMESH_TIMEOUT": "60"}, start_new_session=True)


def _read(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]


def _training(out: Path, first: subprocess.Popen[str], timeout: float) -> Path:
    """The run folder once node 0's ranks train (its TensorBoard runs exist)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and first.poll() is None:
        runs = [p for p in out.glob("*") if (p / "tb").is_dir()]
        if runs:
            return runs[0]
        time.sleep(0.1)
    pytest.fail(f"node 0's launcher started no run within {timeout} s: {first.communicate()[0][-3000:]}")


@pytest.mark.timeout(120)
def test_a_later_launchers_ranks_join_the_running_population_seeded_and_explored(tmp_path):
    """Node 0 trains 2 agents on --nnodes 1:2; node 1's launcher, started once they train, adds agents 2
    and 3: seeded from the best of the first two, explored from there, and trained to the same budget.
    The first two keep their numbers and saw the world grow from 2 to 4; the newcomers saw only 4."""
    endpoint = f"127.0.0.1:{_free_port()}"
    first = _demo("1:2", 0, 2, endpoint, tmp_path, "--steps", "40000")
    run = _training(tmp_path, first, timeout=60)
    later = _demo("1:2", 1, 2, endpoint, tmp_path, "--steps", "40000")
    (code_a, out_a), (code_b, out_b) = finish_launchers([first, later], timeout=100)
    assert (code_a, code_b) == (0, 0), out_a[-3000:] + out_b[-3000:]
    assert "this launcher's 2 rank(s) (2 to 3) join the population" in out_b
    assert [p.name for p in tmp_path.iterdir()] == [run.name]  # one run folder, node 0's
    summary = json.loads((run / "summary.json").read_text())
    assert [a["rank"] for a in summary["agents"]] == [0, 1, 2, 3], summary["agents"]
    assert all(a["steps"] >= 40000 for a in summary["agents"])
    assert (summary["world_size"], summary["world_sizes"], summary["generation"]) == (4, [2, 4], 1)
    joined = [e for e in _read(run, "events.jsonl") if e.get("kind") == "joined"]
    assert [e["rank"] for e in joined] == [2, 3] and joined == summary["joined"], joined
    for event in joined:
        assert event["donors"] and set(event["donors"]) <= {0, 1} and event["newcomers"] == [2, 3], event
        assert (event["world_size"], event["generation"]) == (4, 1) and event["iteration"] > 0, event
        _check_explored(event)
    rows = _read(run, "history.jsonl")
    for agent in (0, 1):  # trained before the join in a world of 2, then in one of 4
        sizes = [r["world_size"] for r in rows if r["rank"] == agent]
        assert sizes == sorted(sizes) and sizes[0] == 2 and sizes[-1] == 4, sizes
    for agent in (2, 3):  # from their donor's iteration on, in a world of 4
        theirs = [r for r in rows if r["rank"] == agent]
        assert theirs and all(r["world_size"] == 4 and r["iteration"] >= joined[0]["iteration"] for r in theirs)
    assert "rank 2 joined at iteration" in out_a and "world sizes: 2 → 4" in out_a, out_a[-3000:]
    trace = json.loads((run / "trace.json").read_text())
    assert trace["metadata"]["missing_ranks"] == [] and trace["metadata"]["ranks"] == [0, 1, 2, 3]


def _check_explored(event: dict) -> None:
    """A newcomer explored its learning rate and entropy coefficient from what it inherited, within range
    (a value at an edge of its range may stay)."""
    assert event["explored"], event
    for name, (low, high) in (("lr", LR_RANGE), ("ent_coef", ENT_RANGE)):
        value, inherited = event[name], event[f"{name}_inherited"]
        assert low * (1 - 1e-6) <= value <= high * (1 + 1e-6), event
        edge = min(abs(value - low) / low, abs(value - high) / high) < 1e-6
        assert (name in event["explored"]) == (value != inherited) and (value != inherited or edge), event


@pytest.mark.timeout(90)
def test_a_rank_lost_with_no_restart_left_leaves_and_the_others_finish_without_it(tmp_path):
    """--kill 1:6 on --nnodes 1:2 with 3 ranks: launcher number 1 dies, is marked left, and agents 0 and 2
    re-form as a world of 2 (agent 2 is now rank 1) and train to the budget."""
    endpoint = f"127.0.0.1:{_free_port()}"
    (code, out), = finish_launchers([_demo("1:2", 0, 3, endpoint, tmp_path, "--steps", "10000", "--kill", "1:6")],
                                    timeout=80)
    assert code == 137, out[-3000:]  # the launcher names its lost rank, though the world went on
    assert "rank 1 was killed by SIGKILL" in out and "left the world for good" in out, out[-3000:]
    assert "in an elastic world the others go on without it" in out
    run = next(tmp_path.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert [a["rank"] for a in summary["agents"]] == [0, 2] and all(a["steps"] >= 10000 for a in summary["agents"])
    assert (summary["world_size"], summary["world_sizes"]) == (2, [3, 2]), summary
    left = [e for e in _read(run, "events.jsonl") if e.get("kind") == "left"]
    assert [(e["rank"], e["world_size"]) for e in left] == [(1, 2)] and left == summary["left"], left
    rows = _read(run, "history.jsonl")
    assert max(r["iteration"] for r in rows if r["rank"] == 1) <= 6  # it died at its 7th iteration
    # noticed where rank 0 stood (the ranks run apart), with the last steps agent 1 reported
    assert left[0]["iteration"] > 0 and left[0]["steps"] == max(r["steps"] for r in rows if r["rank"] == 1), left
    sizes = [r["world_size"] for r in rows if r["rank"] == 2]
    assert sizes[0] == 3 and sizes[-1] == 2 and sizes == sorted(sizes, reverse=True), sizes
    assert "rank 1 left for good at iteration" in out and "world sizes: 3 → 2" in out, out[-3000:]


@pytest.mark.timeout(90)
def test_below_min_nodes_the_run_stops_saying_why(tmp_path):
    """--nnodes 2:3, one rank per launcher: node 1's only rank dies, which would leave 1 node: the world
    stops (WorldTooSmall) and both launchers end, naming it."""
    endpoint = f"127.0.0.1:{_free_port()}"
    launchers = [_demo("2:3", node, 1, endpoint, tmp_path, "--steps", "20000", "--kill", "1:4") for node in (0, 1)]
    (code_a, out_a), (code_b, out_b) = finish_launchers(launchers, timeout=80)
    assert code_a != 0 and code_b != 0, out_a[-3000:] + out_b[-3000:]
    assert "WorldTooSmall" in out_a and "below --nnodes MIN=2" in out_a, out_a[-3000:]
    assert "popmesh demo: the population fell below --nnodes MIN and stopped" in out_a
