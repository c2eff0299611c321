"""The demo on an elastic world, without processes: agents named by their launcher number, what a re-form
changed, the events and summary lines of joins and leaves, the view's rows, and the options' checks."""

from __future__ import annotations

import argparse
import re
import time

import pytest

import popmesh
from popmesh.core.errors import ConfigError
from popmesh.demo.cli import configure, failure_note
from popmesh.demo.config import DemoConfig
from popmesh.demo.membership import (
    Change,
    agents_of,
    change,
    joined_events,
    kill_due,
    last_steps,
    left_events,
    sizes_seen,
    steps_goal,
    summary_lines,
)
from popmesh.demo.outputs import plot_returns
from popmesh.demo.reporter import Reporter
from popmesh.demo.view import PopulationView


def test_a_later_launchers_ranks_join_after_the_others():
    assert change([0, 1], [0, 1, 2, 3], newcomers=(2, 3)) == Change(joined=(2, 3))


def test_a_restarted_rank_rejoins_in_its_place():
    assert change([0, 1, 2], [0, 1, 2], newcomers=(1,)) == Change(rejoined=(1,))


def test_a_rank_that_left_is_missing_and_the_ranks_above_it_move_down():
    assert change([0, 1, 2], [0, 2], newcomers=()) == Change(left=(1,))
    assert agents_of([0, 2], [0, 1]) == [0, 2]  # rank 1 is now launcher number 2


def test_a_leave_and_a_join_in_one_re_form_are_told_apart():
    """Launcher 1 left, and a node-1 launcher of 3 ranks (numbers 3, 4, 5) joined: ranks 2 to 4 are new."""
    assert change([0, 1, 2], [0, 2, 3, 4, 5], newcomers=(2, 3, 4)) == Change(joined=(3, 4, 5), left=(1,))


def test_the_sizes_a_run_went_through_skip_repeats():
    sizes = [3]
    for size in (3, 2, 2, 4):
        sizes = sizes_seen(sizes, size)
    assert sizes == [3, 2, 4]


def test_a_join_is_an_event_per_newcomer_with_its_donors_and_what_it_explored():
    explored = {2: {"lr_inherited": 1e-3, "lr": 1.2e-3, "ent_coef_inherited": 1e-2, "ent_coef": 1e-2,
                    "explored": ["lr"]}, 3: None}
    events = joined_events((2, 3), [1], [1.0], time=5.0, iteration=30, steps=15360, generation=1, world_size=4,
                           explored=explored)
    assert [e["rank"] for e in events] == [2, 3]
    first = events[0]
    assert (first["kind"], first["donors"], first["iteration"], first["steps"]) == ("joined", [1], 30, 15360)
    assert (first["generation"], first["world_size"], first["newcomers"]) == (1, 4, [2, 3])
    assert first["lr"] == 1.2e-3 and first["explored"] == ["lr"]
    assert events[1]["explored"] == []  # --no-explore: nothing moved


def test_a_leave_is_an_event_at_the_agents_last_steps():
    history = [{"rank": 1, "steps": 512}, {"rank": 1, "steps": 1024}, {"rank": 0, "steps": 2048}]
    (event,) = left_events((1,), time=7.0, iteration=6, generation=1, world_size=2, last_steps=last_steps(history))
    assert event == {"kind": "left", "rank": 1, "time": 7.0, "iteration": 6, "steps": 1024, "generation": 1,
                     "world_size": 2}
    assert left_events((5,), time=7.0, iteration=6, generation=1, world_size=2, last_steps={})[0]["steps"] is None


def test_kill_names_the_launchers_number_and_only_the_first_life_dies():
    assert kill_due((2, 5), agent=2, iteration=5, restart_count=0)
    assert not kill_due((2, 5), agent=2, iteration=5, restart_count=1)
    assert not kill_due((2, 5), agent=1, iteration=5, restart_count=0)  # rank 1 now, launcher number 1
    assert not kill_due(None, agent=0, iteration=0, restart_count=0)


def test_an_agent_that_left_counts_the_steps_it_had_toward_the_goal():
    assert steps_goal(1000, {0: 400, 1: 300, 2: 0}, left=[1]) == 2300


def test_the_summary_says_who_joined_who_left_and_the_sizes():
    joined = joined_events((2,), [0], [1.0], time=1.0, iteration=12, steps=6144, generation=1, world_size=3,
                           explored={2: {"lr_inherited": 1e-3, "lr": 8e-4, "explored": ["lr"]}})
    left = left_events((1,), time=2.0, iteration=20, generation=2, world_size=2, last_steps={})
    lines = summary_lines({"joined": joined, "left": left, "world_sizes": [2, 3, 2]})
    assert lines == ["rank 2 joined at iteration 12 (a world of 3), seeded by mean(rank 0), then explored: lr "
                     "1.0e-03 → 8.0e-04",
                     "rank 1 left for good at iteration 20; the others went on, a world of 2",
                     "world sizes: 2 → 3 → 2"]
    assert summary_lines({"joined": [], "left": [], "world_sizes": [4]}) == []


def test_the_view_adds_rows_for_newcomers_and_keeps_those_that_left():
    view = PopulationView(2, total_steps=1000, policy="async", live=False, agents=(0, 1))
    view.update(0, steps=500)
    view.update(1, steps=300)
    view.join(2)
    view.update(2, steps=100, mean_return=20.0)
    view.leave(1)
    assert sorted(view.status) == [0, 1, 2] and view.status[1].left and view.present == 2
    assert view.goal() == 2300  # 1000 each for agents 0 and 2; agent 1 stopped at 300
    line = view.progress_line()
    assert "900/2,300 env steps" in line and "r1 — (lr —, ent —, left)" in line and "r2 20" in line
    view.render()  # the live table draws every row


def test_rank_0_records_joins_and_leaves_and_shows_them():
    world = popmesh.init("local")
    view = PopulationView(1, total_steps=100, policy="async", live=False)
    reporter = Reporter(world, view, target=100.0, stop_at_target=False)
    assert reporter.sizes == [1]
    for event in joined_events((3,), [0], [1.0], time=time.time(), iteration=4, steps=2048, generation=1,
                               world_size=2, explored={}):
        reporter.survival(event)
    reporter.survival(left_events((3,), time=time.time(), iteration=9, generation=2, world_size=1,
                                  last_steps={3: 4096})[0])
    assert [e["kind"] for e in reporter.events] == ["joined", "left"]
    assert view.status[3].left
    assert "rank 3 joined, a world of 2: rank 3 ← copy(rank 0)" in view.events[0]
    assert "rank 3 left for good: the others go on, a world of 1" in view.events[1]


def test_returns_png_marks_joins_and_leaves(tmp_path):
    rows = [{"rank": r, "iteration": i, "steps": 512 * (i + 1), "mean_return": 10.0 + i + r, "time": float(i),
             "lr": 1e-3, "ent_coef": 1e-2} for r in (0, 1) for i in range(6)]
    rows += [{"rank": 2, "iteration": i, "steps": 512 * (i + 1), "mean_return": 12.0 + i, "time": float(i),
              "lr": 1e-3, "ent_coef": 1e-2} for i in range(3, 6)]
    events = [*joined_events((2,), [0], [1.0], time=3.0, iteration=3, steps=2048, generation=1, world_size=3,
                             explored={}),
              *left_events((1,), time=5.0, iteration=5, generation=2, world_size=2, last_steps={})]
    plot_returns(tmp_path / "returns.png", rows, events, target=475.0)
    assert (tmp_path / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_the_cli_takes_the_launchers_elastic_options():
    ns = _parse("--nnodes", "1:2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29560", "--ranks", "2")
    assert (ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.ranks) == ((1, 2), 1, "127.0.0.1:29560", 2)
    with pytest.raises(SystemExit):
        _parse("--nnodes", "3:2")


def test_an_elastic_config_and_its_launcher_numbers():
    config = DemoConfig(ranks=2, nnodes=1, max_nodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29560", kill="3:4")
    assert config.elastic and config.nodes_text == "1:2" and config.kill_at() == (3, 4)
    assert not DemoConfig().elastic
    with pytest.raises(ConfigError, match="below --ranks times the nodes"):
        DemoConfig(ranks=2, nnodes=1, max_nodes=2, rdzv_endpoint="127.0.0.1:29560", kill="4:1")


@pytest.mark.parametrize("options, says", [
    ({"engine": "mpi"}, "an MPI job has a fixed size"),
    ({"task": "hypergrid", "ranks": 6}, "--task hypergrid's replay-buffer service"),
    ({"checkpoint_every": 5}, "drop --checkpoint-every and --resume"),
    ({"node_rank": 2}, "--node-rank 2 is outside 0..1"),
    ({"rdzv_endpoint": ""}, "give each the same --rdzv-endpoint HOST:PORT"),
    ({"nnodes": 2, "max_nodes": 2}, "MIN:MAX with 1 <= MIN < MAX"),
])
def test_what_an_elastic_population_cannot_do_is_refused_saying_what_to_do(options, says):
    given = {"ranks": 2, "nnodes": 1, "max_nodes": 2, "rdzv_endpoint": "127.0.0.1:29560", **options}
    with pytest.raises(ConfigError, match=re.escape(says)):
        DemoConfig(**given)


def test_the_demo_says_whether_the_others_went_on():
    assert failure_note(137, elastic=True) == ("popmesh demo: a rank failed (exit 137); in an elastic world the "
                                               "others go on without it; see the summary above")
    assert failure_note(1, elastic=False) == "popmesh demo: a rank failed (exit 1); see the summary above"
    assert "fell below --nnodes MIN and stopped" in failure_note(1, True, "popmesh.core.errors.WorldTooSmall")
