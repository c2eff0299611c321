"""examples/gfn_hypergrid.py at a small size (2-D, height 8, R0 0.1, 80 iterations) on 4 ranks: two
trainers, a replay-buffer manager and the coordinator. Once through ``popmesh demo --task hypergrid``:
its files are there and sane (history, events, TensorBoard scalars, the trace, the service's counts)
and the population learns; once under ``popmesh launch --max-restarts 1`` with trainer 1 killed at
iteration 30 (with the selective policy, and with the lockstep averaging, which waits until both trainers
stand at the same iteration): the other trainer trains on, the manager and the coordinator re-form, and
the restarted process rejoins seeded from it, so both finish every iteration; once with ``--buffers 0 --decide
complete`` on 2 ranks, both trainers: each rank's first validation is the shared agent's
(examples/hypergrid_agent.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from popmesh.demo import hypergrid

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

pytest.importorskip("torch")
pytest.importorskip("gfn")
pytest.importorskip("tensorboard")
pytestmark = pytest.mark.world

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gfn_hypergrid.py"
ITERATIONS, EVERY = 80, 10
SMALL = ["--height", "8", "--r0", "0.1", "--iterations", str(ITERATIONS), "--every", str(EVERY), "--validate-every",
         str(EVERY)]
VALIDATED = [*range(0, ITERATIONS, EVERY), ITERATIONS - 1]


def _rows(run, name):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _history(run, rank):
    return [r for r in _rows(run, "history.jsonl") if r["rank"] == rank]


@pytest.mark.timeout(60)
def test_the_demo_trains_a_population_of_gflownets(tmp_path):
    cmd = [sys.executable, "-m", "popmesh", "demo", "--task", "hypergrid", "--ranks", "4", "--out", str(tmp_path),
           "--", *SMALL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = tmp_path.iterdir()  # runs/<timestamp>/
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine"] == "torch" and summary["ranks"] == 4 and summary["modes"] == 4, summary
    agents = summary["agents"]
    assert [a["rank"] for a in agents] == [0, 1] and all(0 <= a["l1"] <= 2 for a in agents), agents
    assert summary["config"]["policy"] == "selective" and summary["generation"] == 0
    for a in agents:  # every validation, in order, with the agent's final numbers last
        rows = _history(run, a["rank"])
        assert [r["iteration"] for r in rows] == VALIDATED, rows
        assert rows[-1]["l1"] == a["l1"] and rows[-1]["modes"] == a["modes"] and rows[-1]["lr"] == a["lr"]
        assert all(0 < r["lr"] <= 0.1 * (1 + 1e-6) and r["population_modes"] is not None for r in rows), rows
    first = max(_history(run, a["rank"])[0]["l1"] for a in agents)
    assert min(a["l1"] for a in agents) < 0.8 * first, agents  # the population learns the target distribution
    # every mode found, counted alike by the coordinator (over the manager's reports) and the agents' own samples
    assert summary["population_modes"] == 4 and json.loads((run / "coordinator.json").read_text())["modes_found"] == 4
    assert summary["all_modes_at"]["population"] is not None, summary
    served = json.loads((run / "manager-2.json").read_text())
    assert set(served["rows_from"]) == {"0", "1"} and served["errors"] == 0 and served["lost"] == {}, served
    events = _rows(run, "events.jsonl")
    assert all(e["event"] == "replace" for e in events) and len(events) == sum(a["replaced"] for a in agents)
    for e in events:
        assert e["rank"] in (0, 1) and e["donors"] and e["rank"] not in e["donors"], e
        assert e["decided_at"] % EVERY == 0 and e["decided_at"] <= e["iteration"], e
    _check_board(run, agents)
    names = _traced(run, 4)
    assert {"sample", "train", "validate", "population"} <= names[0] & names[1], names
    assert "buffers.DATA" in names[2], names[2]
    assert "modes found by the population: 4/4" in done.stdout and f"wrote {run}/summary.json" in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["selective", "average"])
def test_a_killed_trainer_leaves_the_others_finishing(tmp_path, policy):
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "4", "--max-restarts", "1", "--preload",
           ",".join(hypergrid.PRELOAD), str(EXAMPLE), *SMALL, "--kill-rank", "1", "--kill-at", "30", "--out",
           str(tmp_path), "--policy", policy]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr and "restarted (1 of 1)" in done.stderr, done.stderr[-3000:]
    events = _rows(tmp_path, "events.jsonl")
    (lost,) = [e for e in events if e["event"] == "lost"]
    (back,) = [e for e in events if e["event"] == "rejoined"]
    assert lost["ranks"] == [1] and lost["seen_by"] == 0 and 0 < lost["iteration"] < ITERATIONS, lost
    assert back["rank"] == 1 and back["donors"] == [0] and back["generation"] == 1, back
    assert back["iteration"] >= lost["iteration"], events
    if policy == "average":  # its collective averages wait until both trainers stand at the furthest iteration
        assert back["policy_from"] >= back["iteration"], back
    else:
        assert back["policy_from"] == 0, back
    survivor, restarted = _history(tmp_path, 0), _history(tmp_path, 1)
    assert [r["iteration"] for r in survivor] == VALIDATED, survivor  # it never stopped nor repeated an iteration
    assert {r["generation"] for r in survivor} == {0, 1}
    before = [r["iteration"] for r in restarted if r["generation"] == 0]
    after = [r["iteration"] for r in restarted if r["generation"] == 1]
    assert before and max(before) < 30 and after and after[-1] == ITERATIONS - 1, restarted
    assert min(after) >= back["iteration"], (after, back)  # the newcomer went on from its donor's iteration
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["generation"] == 1 and [a["rank"] for a in summary["agents"]] == [0, 1], summary
    served = json.loads((tmp_path / "manager-2.json").read_text())
    assert served["lost"] == {"1": 1} and set(served["rows_from"]) == {"0", "1"}, served
    assert json.loads((tmp_path / "coordinator.json").read_text())["modes_found"] == summary["population_modes"]
    assert all(names for names in _traced(tmp_path, 4))  # the restarted rank 1's track too


def _check_board(run, agents):
    """TensorBoard's own reader finds one run per trainer with the exact L1 and the modes against iterations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for agent in agents:
        board = EventAccumulator(str(run / "tb" / f"rank-{agent['rank']}"))
        board.Reload()
        tags = set(board.Tags()["scalars"])
        assert {"l1/exact", "modes/found", "modes/population", "loss/tb", "hparams/lr", "train/logZ",
                "population/replaced"} <= tags, tags
        l1 = board.Scalars("l1/exact")
        assert [s.step for s in l1] == VALIDATED and abs(l1[-1].value - agent["l1"]) < 1e-5, l1
        assert board.Scalars("modes/found")[-1].value == agent["modes"]
        assert board.Scalars("population/replaced")[-1].value == agent["replaced"]


def _traced(run, ranks):
    """The span names on each rank's track of the run's trace.json (one named track per rank)."""
    data = json.loads((run / "trace.json").read_text())
    labels = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert sorted(labels) == list(range(ranks)) and data["metadata"]["missing_ranks"] == [], data["metadata"]
    return [{e["name"] for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == r} for r in range(ranks)]


@pytest.mark.timeout(60)
def test_without_the_service_every_rank_trains_the_shared_agent(tmp_path):
    """--buffers 0: two trainer ranks and nothing else, --decide complete; each rank's first validation is
    that of the example's agent (hypergrid_agent.Agent) trained in this process."""
    import torch
    from hypergrid_agent import Agent, Grid, start_lr

    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "2", "--preload", ",".join(hypergrid.PRELOAD), str(EXAMPLE),
           *SMALL, "--buffers", "0", "--decide", "complete", "--seed", "2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["config"]["decide"] == "complete", summary
    agents = summary["agents"]
    assert summary["population_modes"] == len({m for a in agents for m in a["mode_found_at"]})
    assert "(the agents' own samples)" in done.stdout and not list(tmp_path.glob("manager-*.json"))
    torch.set_num_threads(1)
    for a in agents:
        lr = start_lr((1e-5, 0.1), 2, a["rank"])
        assert a["lr_start"] == lr
        agent = Agent(Grid(2, 8, 0.1), seed=2, rank=a["rank"], lr=lr)
        agent.step()
        assert _history(tmp_path, a["rank"])[0]["l1"] == pytest.approx(agent.l1(), abs=1e-6)
        assert [r["iteration"] for r in _history(tmp_path, a["rank"])] == VALIDATED


@pytest.mark.timeout(60)
def test_with_shared_trajectories_every_trainer_trains_on_the_others_batches(tmp_path):
    """--share-trajectories on 3 trainer ranks (--buffers 0): each trainer takes the others' batches as they
    come (nobody waits) and trains on them with its own, timed as ``share``."""
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "3", "--preload", ",".join(hypergrid.PRELOAD), str(EXAMPLE),
           *SMALL, "--buffers", "0", "--share-trajectories", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["share_trajectories"] is True
    agents = summary["agents"]
    assert [a["rank"] for a in agents] == [0, 1, 2], agents
    for a in agents:  # up to one of each other trainer's per iteration; how many arrive in time depends on the pace
        assert 2 <= a["shared_batches"] <= 2 * ITERATIONS, agents
        assert [r["iteration"] for r in _history(tmp_path, a["rank"])] == VALIDATED
    names = _traced(tmp_path, 3)
    assert all("share" in ranks for ranks in names), names
