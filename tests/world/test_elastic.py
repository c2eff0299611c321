"""Elastic worlds (popmesh launch --nnodes MIN:MAX, torch engine): a launcher started later joins the
running world at its next safe point (world.admit()), a rank lost with no restart left leaves it for good
and the others re-form without it, and below MIN nodes the world stops naming what was lost. On loopback
with two launchers on one host, and across two namespace hosts (tests/world/hosts.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosts import TwoHosts, finish_launchers, unavailable
from ports import refusing_port

pytestmark = pytest.mark.world
SCRIPT = str(Path(__file__).parent / "scripts" / "elastic_world.py")
_LINE = re.compile(r"SLOT (\d+) RANK (\d+) SIZE (\d+) SEEN (\[.*?\]) ROSTER (\[.*?\]) GENERATION (\d+)")
_STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE",
          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RESTART_COUNT")


def _env(timeout: str = "60") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STALE and not k.startswith(("SLURM_", "PMI_"))}
    return {**env, "POPMESH_TIMEOUT": timeout}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nodes: str, node: int, nproc: int, endpoint: str, *script: object) -> list[str]:
    return [sys.executable, "-m", "popmesh", "launch", "--nnodes", nodes, "--node-rank", str(node), "-n", str(nproc),
            "--rdzv-endpoint", endpoint, SCRIPT, *map(str, script)]


def _ranks(out: str) -> dict[int, tuple[int, int, str, str]]:
    """Launcher rank -> (final rank, final size, sizes seen, roster)."""
    return {int(m[0]): (int(m[1]), int(m[2]), m[3], m[4]) for m in _LINE.findall(out)}


def _start(argv: list[str], timeout: str = "60") -> subprocess.Popen[str]:
    return subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(timeout),
                            start_new_session=True)


@pytest.mark.timeout(150)
def test_a_launcher_started_later_joins_the_running_world_with_its_ranks():
    """Node 0 starts a world of 2 on --nnodes 1:2; node 1's launcher, started after, adds ranks 2 and 3:
    the first two keep their ranks and their progress, and every sum after the join is 4."""
    endpoint = f"127.0.0.1:{_free_port()}"
    first = _start(_launch("1:2", 0, 2, endpoint, 30, 0.02, -1, 0, 4))
    time.sleep(2.0)
    later = _start(_launch("1:2", 1, 2, endpoint, 30, 0.02, -1, 0, 4))
    (code_a, out_a), (code_b, out_b) = finish_launchers([first, later], timeout=130)
    assert (code_a, code_b) == (0, 0), out_a[-3000:] + out_b[-3000:]
    seen = _ranks(out_a + out_b)
    assert sorted(seen) == [0, 1, 2, 3], out_a[-3000:] + out_b[-3000:]
    for slot, (rank, size, sizes, roster) in seen.items():
        assert (rank, size, roster) == (slot, 4, "[0, 1, 2, 3]"), (slot, seen[slot])
        assert "(4, 4)" in sizes and all(a == b for a, b in re.findall(r"\((\d+), (\d+)\)", sizes)), sizes
    assert "(2, 2)" in seen[0][2] and "(2, 2)" not in seen[2][2]  # the first ranks trained before the join


@pytest.mark.timeout(120)
def test_a_rank_lost_with_no_restart_left_leaves_and_the_others_go_on_without_it():
    endpoint = f"127.0.0.1:{_free_port()}"
    (code, out), = finish_launchers([_start(_launch("1:2", 0, 3, endpoint, 30, 0.02, 2, 10, 3))], timeout=100)
    assert code == 137, out[-3000:]  # the launcher names its lost rank, though the world went on
    assert "rank 2 was killed by SIGKILL" in out and "left the world for good" in out, out[-3000:]
    seen = _ranks(out)
    assert sorted(seen) == [0, 1], out[-3000:]
    for slot in (0, 1):
        rank, size, sizes, roster = seen[slot]
        assert (rank, size, roster) == (slot, 2, "[0, 1]") and "(3, 3)" in sizes and "(2, 2)" in sizes, seen[slot]


@pytest.mark.timeout(120)
def test_below_min_nodes_the_world_stops_and_names_what_was_lost():
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [_start(_launch("2:3", node, 1, endpoint, 30, 0.02, 1, 10, 2)) for node in (0, 1)]
    (code_a, out_a), (code_b, out_b) = finish_launchers(procs, timeout=100)
    assert code_b == 137 and "left the world for good" in out_b, out_b[-3000:]
    assert code_a == 1, out_a[-3000:]
    assert "WorldTooSmall" in out_a and "after losing rank(s) [1] for good" in out_a, out_a[-3000:]
    assert "below --nnodes MIN=2" in out_a and "fell below --nnodes MIN=2: tearing it down" in out_a, out_a[-3000:]


@pytest.mark.timeout(120)
def test_a_launcher_with_another_model_is_refused_and_the_running_world_is_undisturbed():
    endpoint = f"127.0.0.1:{_free_port()}"
    first = _start(_launch("1:2", 0, 2, endpoint, 150, 0.04, -1, 0, 2, "Net: 4 tensors, 97 elements, aaa"))
    time.sleep(1.0)
    later = _start(_launch("1:2", 1, 2, endpoint, 150, 0.04, -1, 0, 2, "Net: 4 tensors, 129 elements, bbb"))
    (code_b, out_b), (code_a, out_a) = finish_launchers([later, first], timeout=100)
    assert code_b == 1 and "this process's model (Net: 4 tensors, 129 elements, bbb) is not the running world's " \
                           "(Net: 4 tensors, 97 elements, aaa)" in out_b, out_b[-3000:]
    assert code_a == 0, out_a[-3000:]
    seen = _ranks(out_a)
    assert {slot: (size, sizes) for slot, (_, size, sizes, _) in seen.items()} == {0: (2, "[(2, 2)]"),
                                                                                 1: (2, "[(2, 2)]")}, out_a[-3000:]


@pytest.mark.timeout(60)
def test_a_joining_launcher_whose_endpoint_does_not_answer_ends_naming_the_address():
    with refusing_port() as port:  # bound by the test, never listened on: nobody serves it
        endpoint = f"127.0.0.1:{port}"
        start = time.monotonic()
        joining = _start(_launch("1:2", 1, 1, endpoint, 30, 0.02, -1, 0, 2), timeout="3")
        (code, out), = finish_launchers([joining], timeout=50)
    assert code == 1 and f"could not reach the rendezvous store at {endpoint} within 3 s" in out, out[-3000:]
    assert time.monotonic() - start < 40, out[-3000:]


@pytest.mark.timeout(180)
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_across_two_hosts_a_third_launcher_joins_and_one_node_leaves_for_good():
    """Host a runs node 0, host b node 1 (--nnodes 2:3, a rank each); a third launcher on host b joins as
    node 2; then node 1's rank is killed with no restart left. Nodes 0 and 2 finish as a world of two."""
    with TwoHosts(names="resolving") as th:
        a, b = th.hosts
        endpoint = f"{a.addr}:29617"
        popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
        procs = [a.start(_launch("2:3", 0, 1, endpoint, 30, 0.02, 1, 10, 3), **popen),
                 b.start(_launch("2:3", 1, 1, endpoint, 30, 0.02, 1, 10, 3), **popen)]
        time.sleep(2.0)
        procs.append(b.start(_launch("2:3", 2, 1, endpoint, 30, 0.02, 1, 10, 3), **popen))
        ended = finish_launchers(procs, timeout=160)
    (code_0, out_0), (code_1, out_1), (code_2, out_2) = ended
    assert (code_0, code_1, code_2) == (0, 137, 0), out_0[-2000:] + out_1[-2000:] + out_2[-2000:]
    assert "left the world for good" in out_1, out_1[-2000:]
    seen = _ranks(out_0 + out_2)
    assert seen[0][:2] == (0, 2) and seen[2][:2] == (1, 2) and seen[0][3] == seen[2][3] == "[0, 2]", seen
    assert "(3, 3)" in seen[0][2] and "(3, 3)" in seen[2][2], seen


@pytest.mark.timeout(150)
def test_the_elastic_population_example_takes_in_a_later_launcher_and_goes_on_without_a_lost_rank():
    """examples/elastic_population.py: node 1's ranks join at a decision, seeded from the two best agents,
    each exploring the learning rate it inherited; launcher rank 1 is then killed with no restart left, and
    the three others finish the run."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "elastic_population.py")
    endpoint = f"127.0.0.1:{_free_port()}"

    def launch(node: int, *extra: str) -> subprocess.Popen[str]:
        return _start([sys.executable, "-m", "popmesh", "launch", "--nnodes", "1:2", "--node-rank", str(node),
                       "-n", "2", "--rdzv-endpoint", endpoint, example, "--iterations", "300", *extra])

    first = launch(0, "--kill", "1:240")
    time.sleep(0.5)
    later = launch(1)
    (code_a, out_a), (code_b, out_b) = finish_launchers([first, later], timeout=130)
    assert (code_a, code_b) == (137, 0), out_a[-3000:] + out_b[-3000:]
    grew = re.search(r"iteration (\d+): the world grew from 2 to 4 ranks", out_a)
    assert grew and int(grew[1]) < 240, out_a[-3000:]
    joined = re.findall(r"joined a world of 4 at iteration (\d+), seeded by mean\(rank (\d), rank (\d)\), "
                        r"lr (\S+) explored to (\S+)", out_b)
    assert len(joined) == 2 and all(it == grew[1] and {a, b} == {"0", "1"} for it, a, b, _, _ in joined), out_b[-3000:]
    inherited = {old for *_, old, _ in joined}
    assert len(inherited) == 1 and all(new != old for *_, old, new in joined), joined  # one donor's lr, each moved
    assert "it left the world for good" in out_a and "done: 3 agents at iteration 300" in out_a, out_a[-3000:]
    assert "(finite: True)" in out_a


@pytest.mark.timeout(150)
def test_the_buffer_service_keeps_everything_stored_while_agents_join_and_one_leaves():
    """Node 0 runs an agent, the manager and the coordinator; node 1's three ranks join as agents of the same
    manager; node 0's agent then leaves for good and every rank above it moves down. Every batch an agent
    sent is stored exactly once (the agent that left: a prefix of its batches), its rows stay counted by
    launcher number, the coordinator kept every agent's mode, and each rank saw the sizes 3, 6 and 5."""
    script = str(Path(__file__).parent / "scripts" / "elastic_buffers.py")
    endpoint = f"127.0.0.1:{_free_port()}"

    def launch(node: int) -> subprocess.Popen[str]:
        return _start([sys.executable, "-m", "popmesh", "launch", "--nnodes", "1:2", "--node-rank", str(node),
                       "-n", "3", "--rdzv-endpoint", endpoint, script, "30"])

    first = launch(0)
    time.sleep(1.0)
    later = launch(1)
    (code_a, out_a), (code_b, out_b) = finish_launchers([first, later], timeout=130)
    assert (code_a, code_b) == (137, 0), out_a[-3000:] + out_b[-3000:]
    manager = json.loads(out_a.split("MANAGER ", 1)[1].splitlines()[0])
    coordinator = json.loads(out_a.split("COORDINATOR ", 1)[1].splitlines()[0])
    agents = {int(m[0]): json.loads(m[1]) for m in re.findall(r"AGENT (\d+) (\{.*\})", out_b)}
    assert sorted(agents) == [3, 4, 5], out_b[-3000:]
    pairs = [tuple(p) for p in manager["pairs"]]
    rows = {slot: sorted(i for s, i in pairs if s == slot) for slot in range(6)}
    for slot in (3, 4, 5):  # four rows a batch, each batch once
        assert rows[slot] == sorted(i for i in range(120) for _ in range(4)), (slot, rows[slot][:40])
    killed = sorted(set(rows[0]))
    assert killed == list(range(len(killed))) and rows[0] == sorted(i for i in killed for _ in range(4)), rows[0]
    assert manager["stats"]["left"] == {"0": len(rows[0])}, manager["stats"]
    assert manager["served"] == [2, 3, 4] and sorted(manager["stats"]["rows_from"]) == ["2", "3", "4"], manager
    assert sorted(manager["seen"], key=lambda s: s[0])[-1][1:] == [0, 5], manager["seen"]  # rank 1 -> 0 in 5
    assert coordinator["stats"]["modes_found"] == 4 and coordinator["seen"][0][1:] == [1, 5], coordinator
    for slot, report in agents.items():  # joined a world of 6 at rank `slot`, then moved down by one
        assert report["seen"][0][1:] == [slot, 6] and report["seen"][-1][1:] == [slot - 1, 5], report
