"""The demo's population policy, as ``--policy`` and its options name it."""

from __future__ import annotations

from typing import Any

from popmesh.demo.config import DemoConfig
from popmesh.demo.learner import PPOLearner
from popmesh.population import (
    PB2,
    AsyncSelectiveAveraging,
    AverageAll,
    DonorRule,
    Explore,
    ReplacementRule,
    SelectiveAveraging,
)

__all__ = ["make_policy"]


def make_policy(config: DemoConfig, learner: PPOLearner, channel: int = 0) -> Any:
    """The population policy named by ``config.policy`` (None for ``none``); ``channel``: the asynchronous
    policy's tag set (the survivors of a lost rank run theirs on another, see :func:`popmesh.demo.survival.regroup`)."""
    selective: dict[str, Any] = dict(  # keyword options shared by both selective policies
        rule=ReplacementRule(ratio=config.ratio), donor_rule=DonorRule(kind="best_k", k=config.donors),
        strategy=config.strategy, optimizer_policy=config.optimizer, include_buffers=True, seed=config.seed,
        optimizer_builder=learner.make_optimizer if config.optimizer == "reset" else None)
    if config.policy == "average-all":
        return AverageAll(config.every, include_buffers=True)
    if config.policy == "selective":
        return SelectiveAveraging(config.every, **selective)
    if config.policy == "async":  # channel 0 on every rank: a policy rebuilt after a loss meets the newcomer's
        if config.library_explores:  # the coordinator hands a replaced agent its donor's values, explored
            space = {k: config.declarations()[k] for k in config.explore}
            selective["explore"] = Explore(keys=config.explore, space=space,
                                           pb2=PB2() if config.explore_method == "pb2" else None)
        return AsyncSelectiveAveraging(config.every, channel=channel, decide=config.decide,
                                       reference=0 if config.reference else None, **selective)
    return None
