"""The demo end to end with tiny settings: 2 ranks, a few iterations, files written and sane."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["async", "none"])
def test_demo_writes_sane_files(tmp_path, policy):
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", "2", "--steps", "4000", "--every", "2",
           "--policy", policy, "--warmup", "0", "--no-live", "--out", str(tmp_path)]
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
    assert "Load imbalance" in done.stdout and "Time per step" in done.stdout
