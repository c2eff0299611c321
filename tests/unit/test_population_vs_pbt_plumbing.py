"""benchmarks/population_vs_pbt.py's pure parts: the target found in a history (the PPO tasks' return,
the hypergrid's L1), the population's steps then, the time per iteration, each task's defaults, and the
Ray side's setup as it travels to its process (benchmarks/_ray_gfn.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))  # the benchmark imports its siblings


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load("population_vs_pbt")
ray_gfn = _load("_ray_gfn")


def history(l1_by_rank: dict[int, list[float]], every: int = 25, lap: float = 1.0) -> list[dict[str, Any]]:
    """Validation rows ``every`` iterations apart, ``lap`` seconds apart; rank r a little after rank r - 1."""
    return [{"rank": rank, "iteration": i * every, "l1": l1, "time": 100.0 + i * lap + rank / 10}
            for rank, values in l1_by_rank.items() for i, l1 in enumerate(values)]


def test_the_hypergrid_target_is_the_first_validation_at_or_below_the_l1() -> None:
    rows = bench.with_steps(history({0: [1.5, 0.5, 0.1], 1: [1.5, 0.09, 0.05]}), per_iteration=16)
    assert [r["steps"] for r in rows if r["rank"] == 0] == [16, 26 * 16, 51 * 16]  # iteration i: i + 1 steps
    got = bench.reach(rows, started=90.0, swaps=[{"rank": 1, "time": 100.5}], hit=bench.l1_at_most(0.1), per_row=25)
    assert (got["rank"], got["steps"]) == (1, 26 * 16)  # rank 1 at iteration 25, before rank 0 at 50
    assert got["population_steps"] == 2 * 26 * 16 and got["was_replaced"] is True
    assert got["wall_s"] == pytest.approx(11.1) and got["train_s"] == pytest.approx(1.1)
    assert got["startup_s"] == 10.0 and got["iteration_ms"] == pytest.approx(1e3 / 25)
    missed = bench.reach(rows, 90.0, [], bench.l1_at_most(0.01), per_row=25)
    assert missed["steps"] is None and missed["population_steps"] is None and missed["wall_s"] is None


def test_the_ppo_target_skips_rows_without_a_return() -> None:
    rows = [{"rank": 0, "steps": 512, "time": 1.0, "mean_return": None},
            {"rank": 1, "steps": 512, "time": 2.0, "mean_return": 480.0},
            {"rank": 0, "steps": 1024, "time": 3.0, "mean_return": 500.0}]
    hit = bench.returns_at_least(475.0)
    assert bench.population_steps(rows, hit) == 1024
    assert bench.reach(rows, 0.0, [], hit)["steps"] == 512


def test_each_task_has_its_own_defaults() -> None:
    ns = bench.parse(["--task", "hypergrid", "cartpole"])
    grid, cartpole = bench.plan_of(ns, "hypergrid", 3), bench.plan_of(ns, "cartpole", 3)
    assert (grid.budget, grid.iterations, grid.every, grid.warmup) == (12_800, 800, 25, 0)
    assert (cartpole.budget, cartpole.every) == (150_000, 10)
    fields = grid.fields()
    assert fields["budget"] == 12_800 and fields["l1_target"] == 0.1 and fields["batch"] == 16
    assert cartpole.fields()["budget"] == 150_016  # whole iterations of 512
    quick = bench.plan_of(bench.parse(["--task", "hypergrid", "--quick", "--every", "10"]), "hypergrid", 0)
    assert (quick.iterations, quick.every) == (200, 10)
    assert bench.plan_of(bench.parse(["--steps", "1000"]), "hypergrid", 0).iterations == 63  # rounded up


def test_the_ray_setup_travels_as_json() -> None:
    setup = ray_gfn.GridSetup("pb2", 2, 800, 25, (1e-5, 0.1), 4, "/tmp/out")
    back = ray_gfn.GridSetup.from_dict(json.loads(json.dumps(asdict(setup))))
    assert back == setup and back.ranges() == {"lr": (1e-5, 0.1)} and back.warmup == 0
