"""The demo end to end with tiny settings: 2 ranks, a few iterations, files written and sane."""

import json
import os
import subprocess
import sys

import pytest

from harness import mpiexec
from popmesh.demo.config import ENT_RANGE, LR_RANGE
from popmesh.population.state.checkpoint import read_manifest


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["async", "none"])
def test_demo_writes_sane_files(tmp_path, policy):
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "2", "--steps", "4000", "--every", "2",
           "--policy", policy, "--warmup", "0", "--out", str(tmp_path), *(["--no-live"] if policy == "none" else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1
    run = runs[0]
    assert f"wrote {run}/returns.png" in done.stdout
    assert (run / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["config"]["policy"] == policy
    assert [a["rank"] for a in summary["agents"]] == [0, 1]
    assert all(a["steps"] >= 4000 for a in summary["agents"])
    assert all(a["mean_return"] is None or 8 <= a["mean_return"] <= 500 for a in summary["agents"])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert len(events) == summary["replacements"]
    if policy == "none":
        assert events == []
    else:
        assert events, "the async policy replaced nobody in 8 iterations with a decision every 2"
    for event in events:
        assert event["rank"] in (0, 1) and event["donors"] and event["rank"] not in event["donors"]
        assert abs(sum(event["weights"]) - 1) < 1e-6
        assert event["decided_at"] % 2 == 0 and event["decided_at"] <= event["iteration"]  # the cadence set (--every 2)
        _check_explored(event, ("lr", "ent_coef"))
    # off a terminal the view prints each event as a line (and progress every 5 s) instead of a live table
    printed = [line for line in done.stdout.splitlines() if "[popmesh demo]" in line and "←" in line]
    assert len(printed) == len(events), done.stdout[-3000:]
    _check_board(run / "tb", summary, events)
    assert "Load imbalance" in done.stdout and "Time per step" in done.stdout
    assert "never makes a rank wait for another" in done.stdout  # async and none: the figure is hypothetical
    names = _traced(run, 2)
    assert {"rollout", "train"} <= names[0] & names[1] and "send" in names[1] and "recv" in names[0]  # rows to 0
    if policy == "async":  # the policy's phases, and its weights and reports moving on its own thread
        assert {"population.report", "population.apply"} & (names[0] | names[1])


def _check_explored(event, names):
    """A replaced agent's event carries each explored value, inherited and in use, within its range; the
    explore step moved each of ``names`` (unless it stayed at an edge of the range) and nothing else."""
    for name, (low, high) in (("lr", LR_RANGE), ("ent_coef", ENT_RANGE)):
        value, inherited = event[name], event[f"{name}_inherited"]
        assert low * (1 - 1e-6) <= value <= high * (1 + 1e-6) and inherited > 0, event
        edge = min(abs(value - low) / low, abs(value - high) / high) < 1e-6
        assert (value != inherited or edge) if name in names else value == inherited, event
        assert (name in event["explored"]) == (value != inherited), event


def _check_board(tb, summary, events):
    """TensorBoard's own reader finds one run per rank with its scalars against env steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for agent in summary["agents"]:
        board = EventAccumulator(str(tb / f"rank-{agent['rank']}"))
        board.Reload()
        tags = set(board.Tags()["scalars"])
        assert {"return/mean_last_20", "speed/steps_per_s", "hparams/lr", "hparams/entropy",
                "population/replaced"} <= tags, tags
        for tag, name in (("lr", "lr"), ("entropy", "ent_coef")):  # the explored values at the last iteration
            last = board.Scalars(f"hparams/{tag}")[-1]
            assert last.step == agent["steps"] and abs(last.value - agent[name]) <= 1e-6 * agent[name]
        replaced = [e for e in events if e["rank"] == agent["rank"]]
        assert board.Scalars("population/replaced")[-1].value == len(replaced)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_with_shared_samples_every_agent_trains_on_the_others_rollouts(tmp_path, engine):
    if engine == "mpi" and mpiexec() is None:
        pytest.skip("mpi4py/MPICH not installed")
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "3", "--steps", "4096", "--every", "2", "--warmup", "0",
           "--engine", engine, "--share-samples", "--no-live", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["config"]["share_samples"] is True
    iterations, others = 4096 // 512, 3 - 1
    for agent in summary["agents"]:  # up to one of each other agent's per iteration; how many arrive in time
        # depends on how far apart the agents run (nobody waits), so only "more than one" is certain
        assert others <= agent["shared_rollouts"] <= others * iterations, summary["agents"]
    assert " share " in done.stdout, done.stdout[-3000:]  # its own row in the timing table


@pytest.mark.timeout(240)
def test_demo_checkpoints_and_resumes_where_it_left_off(tmp_path):
    """--checkpoint-every writes complete checkpoints; --resume takes every agent back (weights, optimizer,
    steps, the policy's state) and says where from; the resumed agents go on from those steps."""
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    common = [sys.executable, "-m", "popmesh", "demo", "--ranks", "2", "--every", "2", "--warmup", "0", "--no-live",
              "--policy", "selective", "--checkpoint-every", "3"]
    first = subprocess.run([*common, "--steps", "4000", "--out", str(first_out)], capture_output=True, text=True,
                           timeout=150)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = next(first_out.iterdir())
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["ckpt-000000003", "ckpt-000000006"], kept  # 8 iterations of 512 steps; due at 3 and 6
    assert json.loads((run / "summary.json").read_text())["checkpoints"]["written"] == 2
    second = subprocess.run([*common, "--steps", "6000", "--out", str(second_out), "--resume", str(run)],
                            capture_output=True, text=True, timeout=150)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/ckpt-000000006 (iteration 6, 3,072 steps per agent)" in second.stdout
    resumed_run = next(second_out.iterdir())
    summary = json.loads((resumed_run / "summary.json").read_text())
    assert summary["resumed_from"] == f"{run}/checkpoints/ckpt-000000006"
    # each agent's explored values come back with it: a rank not replaced at the resumed run's first
    # iteration (6) trains at what it had when the checkpoint was written (after iteration 5)
    saved = {r["rank"]: r for r in _rows(run) if r["iteration"] == 5}
    replaced = {e["rank"] for e in _rows(resumed_run, "events") if e["iteration"] == 6}
    first = {r["rank"]: r for r in _rows(resumed_run) if r["iteration"] == 6}
    kept = [rank for rank in (0, 1) if rank not in replaced]
    assert kept and all(first[r][k] == saved[r][k] for r in kept for k in ("lr", "ent_coef")), (saved, first)
    assert len({saved[0]["lr"], saved[1]["lr"]}) == 2  # the ranks drew their own (seeded per rank)
    assert [a["steps"] for a in summary["agents"]] == [6144, 6144]  # 3,072 resumed + 6 iterations of 512
    names = _traced(run, 2)  # the selective policy: metrics all-gathered, weights exchanged in one all_reduce
    assert {"all_reduce", "all_gather", "population.gather", "population.transfer"} <= names[0] & names[1]


@pytest.mark.timeout(240)
@pytest.mark.skipif(mpiexec() is None, reason="mpi4py/MPICH not installed")
def test_an_mpi_population_restarts_whole_and_resumes_from_its_checkpoint(tmp_path):
    """--engine mpi --max-restarts 1: rank 1 dies at iteration 13; the launcher restarts the whole job, which
    resumes in the same run folder from the checkpoint of iteration 12, and every agent ends its budget."""
    done = subprocess.run([sys.executable, "-m", "popmesh", "demo", "--engine", "mpi", "--ranks", "2", "--no-live",
                           "--max-restarts", "1", "--checkpoint-every", "4", "--kill", "1:13", "--steps", "10000",
                           "--every", "4", "--warmup", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "restarting the whole MPI job (1 of 1)" in done.stderr, done.stderr[-3000:]
    (run,) = tmp_path.iterdir()  # both starts of the job wrote into one run folder
    summary = json.loads((run / "summary.json").read_text())
    assert summary["job_restarts"] == 1 and summary["resumed_from"] == f"{run}/checkpoints/ckpt-000000012", summary
    assert [a["steps"] for a in summary["agents"]] == [10240, 10240]  # 20 iterations of 512, none repeated
    assert min(r["iteration"] for r in _rows(run)) == 12  # this start's rows: from the checkpoint on


@pytest.mark.timeout(90)
def test_demo_on_acrobot_explores_the_entropy_coefficient_alone(tmp_path):
    """--env Acrobot-v1 (3 actions, returns from -500 to 0, target -100) with --explore ent_coef: the
    replaced agents inherit both values and the explore step moves the entropy coefficient only."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--env", "Acrobot-v1", "--ranks", "2", "--steps", "8000",
           "--every", "2", "--warmup", "0", "--explore", "ent_coef", "--stop-at-target",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = next(tmp_path.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env"] == "Acrobot-v1" and summary["target"] == -100.0
    assert summary["config"]["explore"] == ["ent_coef"]
    assert all(a["mean_return"] is None or -500 <= a["mean_return"] <= 0 for a in summary["agents"]), summary
    # a negative target is not reached by a return of -500 (the run would stop early at the target)
    assert summary["reached_target"] is None and all(a["steps"] >= 8000 for a in summary["agents"]), summary
    assert any(a["mean_return"] is not None for a in summary["agents"]), summary  # episodes ended (500 steps)
    events = _rows(run, "events")
    assert events and len(events) == summary["replacements"], done.stdout[-3000:]
    for event in events:
        _check_explored(event, ("ent_coef",))
    assert summary["explored"] == sum(bool(e["explored"]) for e in events) > 0
    assert (run / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    explored = [line for line in done.stdout.splitlines() if "←" in line and "(explored)" in line]
    assert len(explored) == summary["explored"] and all("ent_coef " in line and "lr " not in line
                                                         for line in explored), done.stdout[-3000:]


def test_demo_with_pb2_and_a_reference_agent(tmp_path):
    """--explore-method pb2 --reference: rank 0 is never replaced nor a donor, and the replaced agents
    train at values within the declared ranges that PB2's model (or, before it has data, the
    perturbation) picked from their donors'."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "3", "--steps", "10000", "--every", "1",
           "--warmup", "0", "--explore-method", "pb2", "--reference", "--no-live", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = next(tmp_path.iterdir())
    events = _rows(run, "events")  # how many depends on the returns (two members compared, both gaps)
    assert len(events) == json.loads((run / "summary.json").read_text())["replacements"]
    assert all(e["rank"] != 0 and 0 not in e["donors"] for e in events), events
    for e in events:
        # values as the model carries them (float32 buffers): a value clipped to a bound comes back within 1e-6 of it
        assert 1e-5 * (1 - 1e-6) <= e["lr"] <= 1e-1 * (1 + 1e-6), e
        assert 1e-4 * (1 - 1e-6) <= e["ent_coef"] <= 1e-1 * (1 + 1e-6), e
    assert "rank 0 (reference)" in done.stdout


def _rows(run, name="history"):
    return [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_demo_population_carries_on_when_a_rank_is_lost(tmp_path):
    """--kill 1:4 with --max-restarts 1: rank 1 dies at iteration 4, is restarted, rejoins seeded by the
    best survivors, and every agent reaches the step budget; the loss and the rejoin are in
    events.jsonl and summary.json; the survivors trained on as a population of two while it restarted
    (replacing each other where one trails, never it) and their iterations ran on (none repeated), checkpointing among
    themselves. A run resumed from such a checkpoint seeds rank 1 from the others, as at a rejoin. The ranks
    start anew (--no-preload): a forked restart is back before the survivors have decided anything;
    the resumed run forks them."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "3", "--steps", "20000", "--every", "2", "--warmup",
           "0", "--no-live", "--max-restarts", "1", "--kill", "1:4", "--checkpoint-every", "2", "--no-preload",
           "--checkpoint-keep", "100", "--out", str(tmp_path / "a")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr and "restarted (1 of 1)" in done.stderr, done.stderr[-3000:]
    assert "popmesh launch: warning" not in done.stderr  # 3 agents on fewer cores: the demo's calm note instead
    assert ("popmesh demo: 3 agents on" in done.stderr) == (len(os.sched_getaffinity(0)) < 3), done.stderr[-3000:]
    run = next((tmp_path / "a").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["generation"] == 1 and [a["steps"] for a in summary["agents"]] == [20480] * 3, done.stderr[-3000:]
    (rejoined,) = summary["restarts"]
    assert rejoined["rank"] == 1 and set(rejoined["donors"]) <= {0, 2} and rejoined["donors"]
    alone = rejoined["iterations_alone"]  # nobody waited for the restarted process: the survivors trained on
    leaving = rejoined["survivor_leaving_s"]  # seconds each survivor spent leaving and forming their group
    assert len(leaving) == 3 and leaving[1] == 0 and leaving[0] > 0 and leaving[2] > 0, rejoined
    assert alone[1] == 0 and alone[0] > 0 and alone[2] > 0, rejoined
    assert all(names for names in _traced(run, 3))  # the restarted rank 1's track too
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e["rank"]) for e in events if "kind" in e]
    assert kinds == [("lost", 1), ("rejoined", 1)], kinds
    lost_at = next(e for e in events if e.get("kind") == "lost")["iteration"]  # where a survivor noticed
    assert 4 <= lost_at < rejoined["iteration"], events
    # Two survivors that share one agent's weights (and so its returns) can stay level through the hole: then
    # they replace nothing, and the checkpoints they wrote alone (below) show that they went on as a population.
    _decided_among_survivors(events, lost=1, survivors=2, required=False)
    assert summary["replacements"] == len(events) - 2
    assert "rank 1 was lost and rejoined after" in done.stdout
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    for rank in (0, 2):  # the survivors' iterations ran on, none repeated
        its = [r["iteration"] for r in rows if r["rank"] == rank]
        assert its == sorted(set(its)) and len(its) >= 38, its
    written = {int(p.name.split("-")[1]): read_manifest(p) for p in sorted((run / "checkpoints").iterdir())}
    short = [at for at, m in written.items() if 4 < at <= rejoined["iteration"]]  # by the survivors alone
    assert short and all(written[at]["missing"] == [1] and written[at]["ranks"] == [0, 2] for at in short), written
    assert all(m["missing"] == [] for at, m in written.items() if at not in short), written  # before, after
    at = short[-1]
    resume = [a for a in cmd[:cmd.index("--out")] if a not in ("--kill", "1:4", "--steps", "20000", "--no-preload")]
    checkpoint = run / "checkpoints" / f"ckpt-{at:09d}"
    resumed = subprocess.run([*resume, "--steps", str(at * 512 + 1000), "--out", str(tmp_path / "b"), "--resume",
                              str(checkpoint)], capture_output=True, text=True, timeout=150)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} (iteration {at}, {at * 512:,} steps per agent)" in resumed.stdout
    again = json.loads((next((tmp_path / "b").iterdir()) / "summary.json").read_text())
    (seeded,) = again["resumed_seeded"]
    assert seeded["rank"] == 1 and set(seeded["donors"]) <= {0, 2} and seeded["donors"], again
    assert f"rank 1 was lost when that checkpoint was written: seeded from ranks {seeded['donors']}" in resumed.stdout
    assert [a["steps"] for a in again["agents"]] == [(at + 2) * 512] * 3 and again["restarts"] == []


@pytest.mark.timeout(150)
def test_a_lockstep_policy_carries_on_among_the_survivors_and_meets_the_rejoined_rank_in_step(tmp_path):
    """--policy selective decides with collectives at the same iteration on every rank: the two survivors
    decide among themselves while rank 1 restarts, and after the rejoin every rank decides in step
    again (ranks that met at different iterations catch up first) through to the end of the run."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "3", "--steps", "12000", "--every", "2", "--warmup",
           "0", "--no-live", "--max-restarts", "1", "--kill", "1:3", "--policy", "selective", "--no-preload",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = next(tmp_path.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert [a["steps"] for a in summary["agents"]] == [12288] * 3 and summary["generation"] == 1
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    back = _decided_among_survivors(events, lost=1, survivors=2)
    after = [e for e in events if "kind" not in e and e["time"] > back]  # none if the restart took most of the run
    assert all("of 3 agents" in e["summary"] for e in after), events


def _decided_among_survivors(events, lost, survivors, required=True):
    """The survivors' policy decided among them while ``lost`` restarted: replacements of a population of
    ``survivors`` (named in global ranks; at least one if ``required``), between the loss and the rejoin,
    none picking ``lost``. A decision of the whole population made just before the loss may be recorded a
    moment after a survivor noticed it, so the window alone does not tell them apart. Returns the rejoin's
    time."""
    noticed, back = (next(e["time"] for e in events if e.get("kind") == kind) for kind in ("lost", "rejoined"))
    among = [e for e in events if "kind" not in e and f"of {survivors} agents" in e["summary"]]
    assert among or not required, events
    assert all(e["rank"] != lost and lost not in e["donors"] and noticed < e["time"] < back for e in among), events
    return back


def _traced(run, ranks):
    """The span names on each rank's track of the run's trace.json (one track per rank, named)."""
    data = json.loads((run / "trace.json").read_text())
    labels = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert sorted(labels) == list(range(ranks)) and all(labels[r].startswith(f"rank {r} (") for r in labels)
    assert data["metadata"]["missing_ranks"] == []
    return [{e["name"] for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == r} for r in range(ranks)]
