"""Roles to groups and timing reports in a world of one (the multi-rank versions run in tests/world)."""

from __future__ import annotations

import io

import pytest

import popmesh
from popmesh import ConfigError
from popmesh.observe.reports import ImbalanceReport, Timer, TimeReport
from popmesh.topology.layout import RankLayout


@pytest.fixture(scope="module")
def world():
    return popmesh.init("local")


def test_roles_of_one_training_rank(world):
    ctx = popmesh.assign_roles(world)
    assert ctx.training_ranks == [0] and ctx.is_training_rank() and not ctx.is_buffer_rank()
    assert not ctx.is_coordinator_rank() and ctx.coordinator_rank is None and ctx.buffer_group is None
    assert ctx.assigned_buffer is None and ctx.assigned_training_ranks is None and ctx.buffer_rank_set == set()
    assert ctx.agent_group_id == 0 and ctx.agent_group is ctx.train_global_group
    assert popmesh.all_reduce(3, group=ctx.agent_group) == 3
    ctx.cleanup()
    ctx.cleanup()
    assert ctx.agent_groups == [] and not world.finalized


def test_roles_check_sizes(world):
    with pytest.raises(ConfigError):
        popmesh.assign_roles(world, num_buffers=1)
    with pytest.raises(ConfigError):
        popmesh.assign_roles(world, RankLayout.build(2))


def gathered():
    return [{"rollout": [1.0, 1.0], "update": [0.5]}, {"rollout": [2.0, 2.0], "update": [0.5]}]


def test_reports_from_gathered_timings(tmp_path):
    out = io.StringIO()
    report = popmesh.report_timings(gathered(), 2, file=out, chart=tmp_path / "t.png")
    assert isinstance(report, TimeReport) and report.stragglers == (1,)
    assert "rollout" in out.getvalue() and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    imbalance = popmesh.report_imbalance(gathered(), file=io.StringIO())
    assert isinstance(imbalance, ImbalanceReport)
    assert imbalance.steps[0].name == "rollout" and imbalance.steps[0].waiting_total == 1.0  # (max - mean) x 2
    with pytest.raises(ConfigError):
        popmesh.report_timings(gathered(), 3, show=False)


def test_reports_from_this_ranks_timer(world):
    timer = Timer()
    timer.record("step", 0.25)
    assert popmesh.gather_timings(timer) == [{"step": [0.25]}]
    assert popmesh.gather_timings({"step": (0.5,)}, dst=None, barrier=True) == [{"step": [0.5]}]
    report = popmesh.report_timings(timer, show=False, group=world)
    assert report.world_size == 1 and report.step("step").totals == (0.25,)
    with pytest.raises(ConfigError):
        popmesh.report_timings(gathered(), group=world)
    with pytest.raises(ConfigError):
        popmesh.gather_timings(["not", "a", "timer"])
