"""The figures and tables of benchmarks/gfn_population.py from closed-form runs: the population-mean and
worst-agent L1 of a history, the iterations charged where a mode was never found, and the per-seed
comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))  # the benchmark imports its siblings (_common, _pbt_tables, _ray_pbt)
_SPEC = importlib.util.spec_from_file_location("gfn_population", _DIR / "gfn_population.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
sys.modules["gfn_population"] = bench  # its dataclass looks its module up
_SPEC.loader.exec_module(bench)


def rows(l1_by_rank: dict[int, list[float]], every: int = 25) -> list[dict[str, Any]]:
    return [{"rank": rank, "iteration": i * every, "l1": l1, "time": float(i)}
            for rank, values in l1_by_rank.items() for i, l1 in enumerate(values)]


def test_figures_are_the_population_mean_and_the_worst_agent():
    got = bench.figures(rows({0: [1.5, 1.0, 0.5], 1: [1.5, 0.5, 0.25]}), trainers=2)
    assert got["final_mean_l1"] == 0.375 and got["final_worst_l1"] == 0.5
    assert got["mean_mean_l1"] == pytest.approx((1.5 + 0.75 + 0.375) / 3)
    assert got["mean_worst_l1"] == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    assert got["curve"] == [[0, 1.5, 1.5], [25, 0.75, 1.0], [50, 0.375, 0.5]]


def test_a_validation_not_every_trainer_reported_is_left_out():
    got = bench.figures(rows({0: [1.5, 1.0, 0.5], 1: [1.5, 0.5]}), trainers=2)
    assert [c[0] for c in got["curve"]] == [0, 25] and got["final_worst_l1"] == 1.0


def run(contender: str, seed: int, final: float, population: int | None) -> dict[str, Any]:
    return {"contender": contender, "seed": seed, "task": bench.asdict(bench.Task(iterations=1000)),
            "final_mean_l1": final, "final_worst_l1": final, "mean_mean_l1": final, "mean_worst_l1": final,
            "all_modes_agent": population, "all_modes_population": population, "replacements": 0,
            "lr_start": [1e-3, 1e-2], "wall_s": 10.0, "train_s": 8.0}


def test_a_mode_never_found_counts_as_the_iterations_and_is_said():
    runs = [run("none", 0, 0.5, None), run("none", 1, 0.5, 100), run("none", 2, 0.5, 300)]
    assert [bench.charged(r, "all_modes_population") for r in runs] == [1000, 100, 300]
    assert bench.modes_spread(runs, "all_modes_population") == "300 (100–1,000), never in 1"


def test_popmesh_is_compared_seed_by_seed():
    runs = [run("popmesh", s, 0.1, 80) for s in range(3)] + [run("none", 0, 0.2, 80), run("none", 1, 0.05, 80),
                                                              run("none", 2, 0.1, 80)]
    table = bench.report(runs)
    assert "| none | 3 | 1 / 1 / 1, p = 1 |" in table, table
    assert "Warning" not in table
    runs[-1]["lr_start"] = [1e-3, 2e-2]
    assert "**Warning**: seeds [2] did not start every contender at the same learning rates." in bench.report(runs)
