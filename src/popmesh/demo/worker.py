"""One rank of the demo: a PPO agent on CartPole, a population policy, and (on rank 0) the view.

Launched by ``popmesh demo`` as ``python -m popmesh.demo.worker --config '<json>'`` on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import popmesh
from popmesh.demo.config import DemoConfig, rank_hyper, rank_seed
from popmesh.demo.learner import CartPoleLearner
from popmesh.demo.outputs import new_run_dir, plot_returns, write_events, write_summary
from popmesh.demo.reporter import Reporter
from popmesh.demo.view import PopulationView
from popmesh.observe.reports import Timer, print_report
from popmesh.observe.timing import report_imbalance, report_timings
from popmesh.population import AsyncSelectiveAveraging, AverageAll, DonorRule, ReplacementRule, SelectiveAveraging

__all__ = ["make_policy", "run", "main"]


def make_policy(config: DemoConfig, learner: CartPoleLearner) -> Any:
    """The population policy named by ``config.policy`` (None for ``none``)."""
    selective: dict[str, Any] = dict(  # keyword options shared by both selective policies
        rule=ReplacementRule(ratio=config.ratio), donor_rule=DonorRule(kind="best_k", k=config.donors),
        strategy=config.strategy, optimizer_builder=learner.make_optimizer, include_buffers=True, seed=config.seed)
    if config.policy == "average-all":
        return AverageAll(config.every, include_buffers=True)
    if config.policy == "selective":
        return SelectiveAveraging(config.every, **selective)
    if config.policy == "async":
        return AsyncSelectiveAveraging(config.every, **selective)
    return None


def run(config: DemoConfig) -> dict[str, Any] | None:
    """Train until each agent has taken ``config.steps`` steps (or the target is hit, if asked)."""
    import torch

    torch.set_num_threads(1)
    world = popmesh.init(engine=config.engine)
    learner = CartPoleLearner(rank_seed(config.seed, world.rank), rank_hyper(config.seed, world.rank),
                              init_seed=config.seed)
    policy = make_policy(config, learner)
    live = config.live and sys.stdout.isatty()  # rank 0 holds the terminal only when the launcher gave it
    view = PopulationView(world.size, config.steps, config.policy, live=live) if world.is_main else None
    reporter = Reporter(world, view, config.target, config.stop_at_target)
    if view is not None:
        view.start()
    timer = Timer()
    try:
        _train(world, config, learner, policy, reporter, timer)
        if hasattr(policy, "shutdown"):
            policy.shutdown()
        reporter.finish()  # before the view's last frame, so it shows every rank's final numbers
    finally:
        if view is not None:
            view.stop()
    summary = _finish(world, config, learner, reporter, timer)
    learner.close()
    world.finalize()
    return summary


def _train(world: Any, config: DemoConfig, learner: CartPoleLearner, policy: Any, reporter: Reporter,
           timer: Timer) -> None:
    iteration, started = 0, time.monotonic()
    while learner.total_steps < config.steps and not reporter.should_stop():
        learner.iterate(timer)
        metric = learner.mean_return()
        event = None
        if policy is not None and iteration >= config.warmup:
            with timer.section("population"):
                learner.model, optimizer, info = policy(iteration - config.warmup, learner.model,
                                                        learner.optimizer, metric)
            learner.optimizer = optimizer if optimizer is not None else learner.optimizer
            event = None
            if info.replaced:
                learner.adopt_learning_rate()
                event = _event(world.rank, learner, info, metric)
        row = {"rank": world.rank, "iteration": iteration, "steps": learner.total_steps,
               "mean_return": None if math.isnan(metric) else metric, "time": time.time(),
               "steps_per_s": learner.total_steps / max(time.monotonic() - started, 1e-9),
               "lr": learner.optimizer.param_groups[0]["lr"]}
        reporter.record(row, event)
        iteration += 1


def _event(rank: int, learner: CartPoleLearner, info: Any, metric: float) -> dict[str, Any]:
    return {"time": time.time(), "rank": rank, "iteration": info.iteration, "steps": learner.total_steps,
            "donors": list(info.donors), "weights": list(info.weights), "strategy": info.strategy or "mean",
            "metric_before": None if math.isnan(metric) else metric, "optimizer": info.optimizer,
            "summary": info.summary}


def _finish(world: Any, config: DemoConfig, learner: CartPoleLearner, reporter: Reporter,
            timer: Timer) -> dict[str, Any] | None:
    finals = popmesh.gather_object({"rank": world.rank, "steps": learner.total_steps,
                                    "mean_return": None if math.isnan(learner.mean_return()) else learner.mean_return(),
                                    "lr": learner.learning_rate(), "entropy": learner.hyper.entropy}, dst=0)
    times = report_timings(timer, group=world, show=False)
    imbalance = report_imbalance(timer, group=world, show=False)
    if not world.is_main:
        return None
    out = new_run_dir(config.out_dir)
    summary = {"config": config.to_dict(), "agents": finals, "reached_target": reporter.reached,
               "replacements": len(reporter.events), "engine": world.engine_name, "ranks": world.size}
    write_events(out / "events.jsonl", reporter.events)
    write_summary(out / "summary.json", summary)
    plot_returns(out / "returns.png", reporter.history, reporter.events, config.target)
    _print_summary(summary, times, imbalance, out)
    return summary


def _print_summary(summary: dict[str, Any], times: Any, imbalance: Any, out: Any) -> None:
    print("\nagents at the end:")
    for agent in summary["agents"]:
        ret = "—" if agent["mean_return"] is None else f"{agent['mean_return']:.1f}"
        print(f"  rank {agent['rank']}: lr {agent['lr']:.1e}  steps {agent['steps']:,}  return (last 20) {ret}")
    reached = summary["reached_target"]
    print(f"replacements: {summary['replacements']};  target: "
          + (f"rank {reached['rank']} after {reached['agent_steps']:,} steps" if reached else "not reached"))
    print_report(times)
    print_report(imbalance)
    print(f"\nwrote {out}/returns.png, {out}/events.jsonl, {out}/summary.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of popmesh's demo")
    parser.add_argument("--config", required=True, help="DemoConfig as JSON")
    ns = parser.parse_args(argv)
    run(DemoConfig(**json.loads(ns.config)))


if __name__ == "__main__":
    main()
