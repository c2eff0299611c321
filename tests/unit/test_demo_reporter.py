"""The demo's stop at the target, in a world of one: at once, or (with checkpoints) at the next one."""

from __future__ import annotations

import time

import popmesh
from popmesh.demo.reporter import Reporter


def _row(iteration: int, mean_return: float) -> dict:
    return {"rank": 0, "iteration": iteration, "steps": 512 * (iteration + 1), "mean_return": mean_return,
            "time": time.time(), "steps_per_s": 1000.0, "lr": 1e-3, "ent_coef": 1e-2}


def test_without_checkpoints_the_run_stops_once_the_target_is_seen():
    reporter = Reporter(popmesh.init("local"), None, target=100.0, stop_at_target=True)
    reporter.record(_row(0, 50.0), None)
    assert not reporter.should_stop()
    reporter.record(_row(1, 120.0), None)
    assert reporter.should_stop() and reporter.reached["iteration"] == 1


def test_with_checkpoints_the_ranks_stop_together_after_the_next_checkpoint():
    reporter = Reporter(popmesh.init("local"), None, target=100.0, stop_at_target=True, at_checkpoints=True)
    reporter.agree_at_checkpoint()
    assert not reporter.should_stop()
    reporter.record(_row(3, 120.0), None)
    assert not reporter.should_stop()  # the target is seen, but the stop waits for the checkpoint
    reporter.agree_at_checkpoint()
    assert reporter.should_stop()


def test_rows_kept_back_by_a_detached_rank_that_reached_the_target_earlier_take_the_credit():
    """Rank 0 learns of a survivor's rows only after the world re-formed: the earliest row at the target
    counts, not the first to arrive."""
    reporter = Reporter(popmesh.init("local"), None, target=100.0, stop_at_target=False)
    early = _row(5, 130.0)
    late = {**_row(9, 120.0), "rank": 1}
    reporter._ingest(late, None)
    reporter._ingest({**early, "rank": 2}, None)
    assert reporter.reached is not None and reporter.reached["rank"] == 2 and reporter.reached["iteration"] == 5


def test_a_detached_rank_keeps_its_rows_and_sends_no_message():
    reporter = Reporter(popmesh.init("local"), None, target=100.0, stop_at_target=True)
    reporter.detach()
    reporter.record(_row(0, 120.0), None)  # rank 0 of a world of one: its own rows are taken in at once
    assert reporter.should_stop() and reporter.own and reporter.history
    reporter.reconnect()
    assert reporter.should_stop()


def test_without_stop_at_target_the_run_never_stops_early():
    reporter = Reporter(popmesh.init("local"), None, target=100.0, stop_at_target=False, at_checkpoints=True)
    reporter.record(_row(0, 500.0), None)
    reporter.agree_at_checkpoint()
    assert not reporter.should_stop() and reporter.reached is not None


def test_a_baseline_run_is_drawn_as_its_best_agent(tmp_path):
    import json

    import pytest

    from popmesh import ConfigError
    from popmesh.demo.config import DemoConfig
    from popmesh.demo.outputs import best_curve, plot_returns, read_history

    rows = [{"rank": 0, "steps": 512, "mean_return": 10.0}, {"rank": 1, "steps": 512, "mean_return": 30.0},
            {"rank": 0, "steps": 1024, "mean_return": 50.0}, {"rank": 1, "steps": 1024, "mean_return": None},
            {"rank": 1, "steps": 1536, "mean_return": 20.0}]
    assert best_curve(rows) == ([512, 512, 1024, 1536], [10.0, 30.0, 50.0, 50.0])
    (tmp_path / "history.jsonl").write_text("".join(json.dumps({**r, "time": 0.0}) + "\n" for r in rows))
    assert read_history(tmp_path) == [{**r, "time": 0.0} for r in rows]
    plot_returns(tmp_path / "returns.png", rows, [], 475.0, read_history(tmp_path), "none")
    assert (tmp_path / "returns.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match=r"no history\.jsonl"):
        DemoConfig(baseline=str(tmp_path / "missing"))


def test_the_demo_says_once_and_calmly_why_more_agents_than_cores_is_fine():
    from popmesh.demo.cli import shared_cores_note

    note = shared_cores_note(4, 2)
    assert note.startswith("popmesh demo: 4 agents on 2 CPU cores") and "never waits" in note
    assert "--ranks 2 gives each rank a core" in note and "warning" not in note
    assert "--policy average-all waits for the slowest rank" in shared_cores_note(4, 1, "average-all")
    assert "on 1 CPU core," in shared_cores_note(4, 1)
