"""The statistics and tables of benchmarks/population_vs_pbt.py (benchmarks/_pbt_tables.py): sign test
values in closed form, medians and ranges, and runs that miss the target charged as the budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_pbt_tables.py"
_SPEC = importlib.util.spec_from_file_location("_pbt_tables", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
tables = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tables)

BUDGET = 100


def run(contender: str, seed: int, steps: int | None, wall: float | None = None, total: float = 99.0) -> dict[str, Any]:
    """A run as the benchmark's JSON lines hold it; ``steps=None``: it never reached the target."""
    return {"contender": contender, "task": "cartpole", "seed": seed, "steps": steps, "budget": BUDGET,
            "wall_s": (float(steps) / 10 if wall is None else wall) if steps is not None else None, "total_s": total,
            "env": "CartPole-v1", "target": 475.0, "lr_range": [2e-4, 6e-3], "ent_range": [1e-3, 2e-2], "ranks": 4}


@pytest.mark.parametrize(("wins", "losses", "p"), [
    (0, 0, 1.0),
    (5, 0, 2 / 32),  # all five one way: 2 * (1/2)^5
    (0, 5, 2 / 32),
    (9, 1, 2 * (1 + 10) / 1024),
    (4, 1, 2 * (1 + 5) / 32),
    (3, 3, 1.0),  # an even split: the doubled tail exceeds 1
    (10, 0, 2 / 1024),
])
def test_sign_test_is_the_exact_two_sided_binomial(wins: int, losses: int, p: float) -> None:
    assert tables.sign_test(wins, losses) == pytest.approx(p, rel=1e-12)


def test_median_range() -> None:
    assert tables.median_range([3, 1, 2]) == (2, 1, 3)
    assert tables.median_range([1, 2, 3, 10]) == (2.5, 1, 10)
    assert tables.median_range([]) is None
    assert tables.spread([30_000, None, 10_000, 20_000]) == "20,000 (10,000–30,000)"
    assert tables.spread([1.25, 3.0], " s") == "2.1 s (1.2–3.0)"
    assert tables.spread([None]) == "—"
    assert tables.spread([7, None, 7]) == "7"


def test_a_missed_run_counts_as_the_budget_and_the_whole_run() -> None:
    missed = run("popmesh", 0, None, total=42.0)
    assert tables.charged_steps(missed) == BUDGET
    assert tables.charged_wall(missed) == 42.0
    hit = run("popmesh", 1, 30, wall=5.0)
    assert (tables.charged_steps(hit), tables.charged_wall(hit)) == (30, 5.0)
    assert tables.worst([hit, missed]) is missed


def test_compare_pairs_seeds_and_charges_misses() -> None:
    ours = [run("popmesh", 0, 10), run("popmesh", 1, 20), run("popmesh", 2, 30), run("popmesh", 3, None),
            run("popmesh", 9, 1)]  # seed 9: the other never ran it, left out
    theirs = [run("none", 0, 20), run("none", 1, 20), run("none", 2, 40), run("none", 3, 50)]
    c = tables.compare(ours, theirs)
    assert c is not None
    assert (c.seeds, c.fewer, c.more, c.equal) == (4, 2, 1, 1)  # seed 3: the budget (100) against 50
    assert c.p == pytest.approx(tables.sign_test(2, 1))
    assert c.steps_ratio == pytest.approx(25 / 30)  # medians of 10, 20, 30, 100 and of 20, 20, 40, 50
    assert tables.compare(ours, [run("none", 7, 5)]) is None


def test_goals_hold_or_not_with_misses_charged() -> None:
    by = {"popmesh": [run("popmesh", s, 40, wall=7.0) for s in range(3)],
          "none": [run("none", 0, 50), run("none", 1, 60), run("none", 2, None)],
          "ray-pbt": [run("ray-pbt", s, 60, wall=10.0) for s in range(3)]}
    found = {goal: holds for goal, _, holds in tables.goals(by)}
    assert found == {"median steps ≥ 20% fewer than ray-pbt": True,  # 40 <= 0.8 * 60
                     "median steps ≥ 20% fewer than none": True,  # 40 <= 0.8 * 60
                     "median wall ≤ 0.7x ray-pbt's": True,  # 7.0 <= 0.7 * 10.0
                     "worst seed no worse than none's": True}  # 40 against the budget, 100
    by["popmesh"][0] = run("popmesh", 0, None, total=8.0)  # now popmesh misses one: charged 100 steps, 8 s
    by["ray-pbt"] = [run("ray-pbt", s, 49, wall=9.0) for s in range(3)]
    found = {goal: holds for goal, _, holds in tables.goals(by)}
    assert found["median steps ≥ 20% fewer than ray-pbt"] is False  # 40 > 0.8 * 49
    assert found["median wall ≤ 0.7x ray-pbt's"] is False  # the median of 8, 7, 7 s is 7 > 0.7 * 9
    assert found["worst seed no worse than none's"] is True  # 100 against 100


def test_per_seed_table_marks_misses_and_the_summary_counts_them() -> None:
    by = tables.by_contender([run("ray-pbt", 0, 30), run("popmesh", 0, None, total=12.5), run("popmesh", 1, 20)])
    assert list(by) == ["popmesh", "ray-pbt"]
    per_seed = tables.per_seed_table(by)
    assert "| popmesh steps | 100† | 20 |" in per_seed
    assert "| popmesh wall | 12.5 s† | 2.0 s |" in per_seed
    assert "| ray-pbt steps | 30 | — |" in per_seed
    summary = tables.summary_table(by)
    assert "| popmesh | 2 | 60 (20–100) |" in summary and "| 1 of 2 |" in summary
    assert "seed 0: 100 steps, 12.5 s" in summary


def test_the_later_of_repeated_runs_is_used() -> None:
    runs = [run("popmesh", 0, 10), run("none", 0, 30), run("popmesh", 0, 20)]
    kept, dropped = tables.latest(runs)
    assert dropped == 1 and sorted(r["steps"] for r in kept) == [20, 30]
    assert "1 run(s) repeat" in tables.report(runs)


def grid_run(contender: str, seed: int, steps: int | None, final: float) -> dict[str, Any]:
    """A hypergrid run as the benchmark's JSON lines hold it: steps are trajectories, the target an L1."""
    return {"contender": contender, "task": "hypergrid", "seed": seed, "steps": steps, "budget": 12_800,
            "wall_s": None if steps is None else 10.0, "total_s": 60.0, "env": "hypergrid 2-D, height 16, R0 0.01",
            "l1_target": 0.1, "lr_range": [1e-5, 0.1], "batch": 16, "ranks": 4, "every": 25, "warmup": 0,
            "final_mean_l1": final, "final_worst_l1": final + 0.5, "mean_mean_l1": final + 0.25,
            "initial": [[1e-3], [2e-4], [6e-4], [1e-5]]}


def test_the_hypergrid_task_reports_its_target_and_final_l1() -> None:
    runs = [grid_run("popmesh", 0, 4_000, 0.05), grid_run("none", 0, None, 0.8), grid_run("popmesh", 1, None, 0.2),
            grid_run("none", 1, None, 0.9)]
    text = tables.task_report(runs)
    assert "### hypergrid: hypergrid 2-D, height 16, R0 0.01, target: an agent's exact L1" in text
    assert "at most 0.1 at a validation (every 25 iterations)" in text and "budget 12,800 trajectories" in text
    assert "| popmesh | 0.125 (0.050–0.200) | 0.625 (0.550–0.700) | 0.375 (0.300–0.450) | 0.050 | 0.200 |" in text
    assert "| none | 0.850 (0.800–0.900) |" in text
    assert "| popmesh steps | 4,000 | 12,800† |" in text  # a miss charged as the budget, in trajectories
    assert "Warning" not in text  # the same initial learning rates in every run of a seed
    assert "entropy" not in tables.task_heading(runs)  # the hypergrid explores the learning rate only


def test_l1_table_leaves_out_the_ppo_tasks() -> None:
    assert "final L1" not in tables.task_report([run("popmesh", 0, 10), run("none", 0, 20)])
    assert tables.l1_spread([]) == "—" and tables.l1_spread([0.5, 0.5]) == "0.500"


def test_each_popmesh_contender_gets_its_own_comparison_and_goals() -> None:
    runs = [run("popmesh", 0, 40), run("popmesh-shared", 0, 20), run("ray-pbt", 0, 60), run("none", 0, 50)]
    report = tables.task_report(runs)
    assert "| popmesh against |" in report and "| popmesh-shared against |" in report
    assert "| goal for popmesh-shared |" in report
    found = {goal: holds for goal, _, holds in tables.goals(tables.by_contender(runs), "popmesh-shared")}
    assert found["median steps ≥ 20% fewer than ray-pbt"] is True  # 20 <= 0.8 * 60
    shared_row = next(line for line in tables.comparison_table(tables.by_contender(runs), "popmesh-shared").splitlines()
                      if line.startswith("| popmesh |"))
    assert "| 1 | 0 | 0 |" in shared_row  # one seed, popmesh-shared fewer steps than popmesh
