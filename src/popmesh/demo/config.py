"""Demo settings and the per-rank diversity of the population (pure)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.demo.learner import Hyper
from popmesh.demo.outputs import history_file

__all__ = ["POLICIES", "STRATEGIES", "LR_RANGE", "DemoConfig", "explore_lr", "rank_hyper", "rank_seed", "sample_lr"]

POLICIES = ("none", "average-all", "selective", "async")
STRATEGIES = ("mean", "weighted_mean", "best_only")


@dataclass(frozen=True)
class DemoConfig:
    """What `popmesh demo` was asked to do."""

    ranks: int = 4
    engine: str = "torch"
    policy: str = "async"
    seed: int = 0
    steps: int = 120_000
    every: int = 10
    ratio: float = 0.25
    strategy: str = "mean"
    donors: int = 2
    warmup: int = 20
    target: float = 475.0
    out_dir: str = "runs"
    live: bool = True
    stop_at_target: bool = False
    checkpoint_every: int = 0  # iterations between population checkpoints (0: none)
    checkpoint_keep: int = 2  # the newest complete checkpoints kept
    resume: str = ""  # a run folder (or one of its checkpoints) to resume from
    max_restarts: int = 0  # restarts per rank (popmesh launch --max-restarts): a lost agent rejoins
    kill: str = ""  # "RANK:ITERATION": that rank's first process SIGKILLs itself there (to watch survival)
    explore: bool = True  # PBT's explore step on a replaced agent's inherited learning rate
    terminal: bool = False  # the user's stdout is a terminal (under mpiexec rank 0's is a pipe to it)
    baseline: str = ""  # an earlier run folder whose best agent returns.png draws beside this run

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"--ranks {self.ranks}: need at least one rank")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.engine not in ("torch", "mpi"):
            raise ConfigError(f"--engine {self.engine!r}: choose torch or mpi")
        if self.steps < 1 or self.every < 1:
            raise ConfigError("--steps and --every must be positive")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.donors < 1 or self.warmup < 0:
            raise ConfigError("--donors must be at least 1 and --warmup not negative")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every}: give 0 (none) or a number of iterations")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep {self.checkpoint_keep}: keep at least the newest checkpoint (1)")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: give 0 or more")
        if self.max_restarts and self.engine != "torch":
            raise ConfigError("--max-restarts needs --engine torch: an MPI world cannot take a restarted rank back")
        if self.kill:
            self.kill_at()
        if self.baseline:
            history_file(self.baseline)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def kill_at(self) -> tuple[int, int] | None:
        """``--kill RANK:ITERATION`` as numbers (None without it)."""
        if not self.kill:
            return None
        rank, _, iteration = self.kill.partition(":")
        if not (rank.isdigit() and iteration.isdigit()) or int(rank) >= self.ranks:
            raise ConfigError(f"--kill {self.kill!r}: give RANK:ITERATION with RANK below --ranks, e.g. --kill 1:60")
        return int(rank), int(iteration)


def rank_seed(seed: int, rank: int) -> int:
    """Distinct, reproducible seeds per rank."""
    return int(seed) * 1000 + rank


LR_RANGE = (2e-4, 6e-3)  # the learning rates the population draws from (log-uniform)


def sample_lr(gen: np.random.Generator) -> float:
    """A learning rate drawn log-uniformly from :data:`LR_RANGE` (the explore step's resampling space)."""
    return float(math.exp(gen.uniform(math.log(LR_RANGE[0]), math.log(LR_RANGE[1]))))


def explore_lr(lr: float, seed: int, rank: int, iteration: int) -> float:
    """PBT's explore step for a replaced agent's inherited learning rate, as Ray Tune's defaults do it:
    resample from the space with probability 0.25, else multiply by 0.8 or 1.2; clipped to the space.
    Seeded by (seed, rank, iteration), so a run is reproducible."""
    from popmesh.population.decisions.explore import explore

    gen = np.random.default_rng([seed, rank, iteration, 11])
    new = float(explore({"lr": lr}, gen, perturb=(0.8, 1.2), resample_prob=0.25, space={"lr": sample_lr})["lr"])
    return min(max(new, LR_RANGE[0]), LR_RANGE[1])


def rank_hyper(seed: int, rank: int) -> Hyper:
    """Each rank draws its own learning rate (log-uniform 2e-4..6e-3) and entropy bonus, so the
    population has good and bad agents to tell apart."""
    rng = np.random.default_rng([seed, rank, 7])
    lr = sample_lr(rng)
    entropy = float(rng.choice([0.0, 0.005, 0.01, 0.02]))
    return Hyper(lr=lr, entropy=entropy)
