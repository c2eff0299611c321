"""Unit tests for the pure timing / load-imbalance reports and the local Timer."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.observe.reports import (
    ImbalanceReport,
    Timer,
    TimeReport,
    format_report,
    imbalance_report,
    print_report,
    save_chart,
    time_report,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_sections_and_records():
    clock = FakeClock()
    timer = Timer(clock)
    with timer.section("rollout"):
        clock.now += 1.5
    with pytest.raises(RuntimeError), timer.section("rollout"):
        clock.now += 0.5
        raise RuntimeError("boom")
    timer.record("sync", 2)
    assert timer.as_dict() == {"rollout": [1.5, 0.5], "sync": [2.0]}
    assert timer.totals() == {"rollout": 2.0, "sync": 2.0}
    timer.as_dict()["rollout"].append(99.0)                       # a copy: the timer is unchanged
    assert timer.as_dict()["rollout"] == [1.5, 0.5]
    timer.reset()
    assert timer.as_dict() == {}


@pytest.mark.parametrize("name, seconds, match", [
    ("a", -1.0, "non-negative"), ("a", math.nan, "non-negative"), ("a", True, "non-negative"), ("", 1.0, "names"),
])
def test_timer_rejects_bad_records(name, seconds, match):
    with pytest.raises(ConfigError, match=match):
        Timer().record(name, seconds)


def _closed_form(n: int) -> list[dict[str, list[float]]]:
    """Rank r spends r + 1 seconds in 'train' per iteration (two iterations) and 1 s in 'log'."""
    return [{"train": [r + 1.0, r + 1.0], "log": 1.0} for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_time_report_closed_form(n):
    rep = time_report(_closed_form(n), world_size=n)
    train = rep.step("train")
    assert train.totals == tuple(2.0 * (r + 1) for r in range(n))
    assert train.means == tuple(r + 1.0 for r in range(n)) and train.counts == (2,) * n
    assert (train.min_total, train.max_total, train.min_rank, train.max_rank) == (2.0, 2.0 * n, 0, n - 1)
    assert train.mean_total == pytest.approx(n + 1.0)
    assert train.scores == pytest.approx(tuple(1 / (r + 1) for r in range(n)))
    assert rep.step("log").totals == (1.0,) * n                      # scalars count as one iteration
    assert rep.rank_totals == tuple(2.0 * (r + 1) + 1.0 for r in range(n))
    assert rep.iteration_times == tuple(r + 2.0 for r in range(n))
    assert rep.scores == pytest.approx(tuple(2 / (r + 2) for r in range(n)))
    assert rep.stragglers == tuple(r for r in range(n) if 2 / (r + 2) < 0.7)


def test_scores_use_time_per_iteration_not_totals():
    rep = time_report([{"a": [1.0] * 4}, {"a": [2.0, 2.0]}])
    assert rep.rank_totals == (4.0, 4.0) and rep.scores == (1.0, 0.5)
    assert rep.step("a").min_total == rep.step("a").max_total == 4.0 and rep.step("a").lowest_score == 0.5


def test_time_report_missing_steps_are_reported_not_fatal():
    timing = [{"train": [1.0], "eval": [5.0]}, {"train": [2.0]}]
    rep = time_report(timing)
    ev = rep.step("eval")
    assert ev.missing_ranks == (1,) and ev.totals == (5.0, None) and ev.scores == (1.0, None)
    assert rep.rank_totals == (1.0, 2.0)                             # only steps on every rank
    assert rep.scores == (1.0, 0.5) and rep.stragglers == (1,)
    assert "missing on" in format_report(rep) and "eval" in format_report(rep)
    with pytest.raises(KeyError, match="steps"):
        rep.step("nope")


def test_zero_times_score_one():
    rep = time_report([{"a": [0.0]}, {"a": [0.0]}])
    assert rep.scores == (1.0, 1.0) and rep.stragglers == ()


def test_imbalance_with_uneven_iterations_regression_torchgfn():
    # torchgfn used rank 0's iteration count for every rank and raised IndexError here.
    timing = [{"step": [1.0, 2.0, 3.0]}, {"step": [3.0, 2.0]}]
    rep = imbalance_report(timing, world_size=2)
    (s,) = rep.steps
    assert s.iterations == 2 and s.dropped == (1, 0)
    assert s.useful == (2.0, 2.0) and s.waiting == (1.0, 0.0)
    assert (rep.useful_total, rep.waiting_total) == (4.0, 1.0)
    assert rep.waiting_fraction == pytest.approx(0.2) and s.waiting_fraction == pytest.approx(0.2)
    assert "dropped per rank [1, 0]" in format_report(rep)


def test_imbalance_skips_steps_missing_on_some_ranks():
    rep = imbalance_report([{"a": 1.0, "b": [2.0]}, {"a": 3.0}, {"a": 2.0}])
    assert [s.name for s in rep.steps] == ["a"] and rep.skipped == {"b": (1, 2)}
    assert rep.steps[0].waiting == (1.0,)
    assert "step 'b' skipped: missing on ranks [1, 2]" in format_report(rep)


def test_empty_iterations_and_empty_report():
    rep = imbalance_report([{"a": []}, {"a": [1.0]}])
    assert rep.steps[0].iterations == 0 and rep.waiting_fraction == 0.0
    assert time_report([{"a": []}, {"a": [1.0]}]).step("a").means == (None, 1.0)


timings = st.integers(1, 4).flatmap(lambda n: st.lists(
    st.lists(st.floats(0.0, 100.0), max_size=6), min_size=n, max_size=n))


@settings(max_examples=60, deadline=None)
@given(timings)
def test_report_properties(per_rank):
    all_timing = [{"s": v} for v in per_rank]
    imb = imbalance_report(all_timing)
    (s,) = imb.steps
    shared = min(len(v) for v in per_rank)
    assert s.iterations == shared and all(w >= 0 for w in s.waiting)
    walls = math.fsum(max(v[i] for v in per_rank) for i in range(shared))
    assert s.useful_total + s.waiting_total == pytest.approx(walls, abs=1e-9)
    rep = time_report(all_timing)
    assert all(0.0 <= x <= 1.0 for x in rep.scores) and max(rep.scores) == 1.0
    json.dumps(rep.to_dict())
    json.dumps(imb.to_dict())


def test_to_dict_is_json():
    timing = _closed_form(3)
    t = json.loads(json.dumps(time_report(timing).to_dict()))
    assert t["steps"][0]["name"] == "train" and t["stragglers"] == [1, 2]
    i = json.loads(json.dumps(imbalance_report(timing).to_dict()))
    assert i["steps"][0]["waiting_fraction"] == pytest.approx(1 / 3) and "waiting_fraction" in i


@pytest.mark.parametrize("timing, kwargs, match", [
    ([], {}, "empty"),
    ([{"a": 1.0}], {"world_size": 2}, "world_size=2"),
    ([{"a": [1.0]}, {"a": [-1.0]}], {}, "rank 1 step 'a'"),
    ([{"a": [math.inf]}], {}, "finite"),
    ([["a"]], {}, "rank 0"),
])
def test_input_validation(timing, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        time_report(timing, **kwargs)
    with pytest.raises(ConfigError, match=match):
        imbalance_report(timing, **kwargs)


def test_threshold_validation():
    with pytest.raises(ConfigError, match="threshold"):
        time_report([{"a": 1.0}], threshold=0.0)


@pytest.mark.parametrize("report", [time_report(_closed_form(3)), imbalance_report(_closed_form(3))])
def test_plain_and_rich_printing(report):
    assert isinstance(report, (TimeReport, ImbalanceReport))
    plain = io.StringIO()
    print_report(report, file=plain, use_rich=False)
    assert plain.getvalue() == format_report(report)
    lines = plain.getvalue().splitlines()
    assert lines[0].endswith("over 3 ranks") and lines[1].startswith("step") and lines[3].startswith("train")
    fancy = io.StringIO()
    print_report(report, file=fancy, use_rich=True)
    assert "train" in fancy.getvalue() and "over 3 ranks" in fancy.getvalue()


def test_save_chart_writes_png(tmp_path):
    out = save_chart(time_report(_closed_form(3)), tmp_path / "timing.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_import_starts_nothing_heavy():
    code = ("import sys, popmesh.observe.reports, popmesh.torch.bucketing, popmesh.population; "
            "heavy = {'matplotlib', 'rich', 'torch'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_non_numeric_step_value_is_rejected():
    with pytest.raises(ConfigError, match="list of seconds"):
        time_report([{"a": None}])


def _demo_like_timings(ranks: int = 4) -> list[dict[str, list[float]]]:
    """Steps and magnitudes as ``popmesh demo`` reports them (long step names, 4-5 significant digits)."""
    return [{"rollout": [0.047 + 0.001 * r] * 235, "train": [0.065 + 0.002 * r] * 235,
             "population": [0.000363 + 0.0001 * r] * 215} for r in range(ranks)]


@pytest.mark.parametrize("make", [time_report, imbalance_report])
def test_rich_tables_fit_an_80_column_terminal_behind_the_rank_prefix(make, monkeypatch):
    """The launcher puts "[rank 0] " (9 characters) before every line rank 0 prints: the table must fit
    in 71 columns, with no header or cell cut short."""
    monkeypatch.setenv("COLUMNS", "71")
    fancy = io.StringIO()
    print_report(make(_demo_like_timings()), file=fancy, use_rich=True)
    text = fancy.getvalue()
    table = text.split("\n\n")[0] if "\n\n" in text else text
    body = [line for line in table.splitlines() if line.strip() and not line.startswith(("time per", "total:",
                                                                                          "stragglers", "straggler:"))]
    assert "…" not in text and all(len(line.rstrip()) <= 71 for line in body), text
    assert "population" in text
