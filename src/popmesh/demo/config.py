"""Demo settings and the per-rank diversity of the population (pure)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.demo.learner import EXPLORED, WINDOW, Hyper
from popmesh.demo.outputs import history_file
from popmesh.population import Continuous, sample_hparams
from popmesh.population import explore as pbt_explore

__all__ = ["POLICIES", "STRATEGIES", "OPTIMIZER_STATES", "ENVS", "TASKS", "EXPLORABLE", "LR_RANGE", "ENT_RANGE",
           "DemoConfig", "declarations", "explore_hyper", "initial_hyper", "parse_explore", "parse_range", "rank_hyper",
           "rank_seed"]

POLICIES = ("none", "average-all", "selective", "async")
STRATEGIES = ("mean", "weighted_mean", "best_only")
OPTIMIZER_STATES = ("reset", "keep", "copy")  # what a replaced agent's optimizer starts from
ENVS = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0}  # each task's target: mean return over the last 20 episodes
TASKS = ("cartpole", "hypergrid")  # PPO agents on a gymnasium task, or GFlowNets on torchgfn's hypergrid
# Options of the CartPole task that --task hypergrid does not take (its own go after --)
CARTPOLE_ONLY = ("env", "steps", "every", "decide", "strategy", "optimizer", "donors", "warmup", "stop_at_target",
                 "checkpoint_every", "checkpoint_keep", "resume", "baseline", "explore", "explore_method", "reference",
                 "ent_range", "ratio", "select_last")
EXPLORABLE = EXPLORED  # what --explore may name: the hyper-parameters the model carries with its weights
LR_RANGE = (1e-5, 1e-1)  # where each rank draws its learning rate (log-uniform); explore stays within it
ENT_RANGE = (1e-4, 1e-1)  # likewise for the entropy coefficient


@dataclass(frozen=True)
class DemoConfig:
    """What `popmesh demo` was asked to do."""

    ranks: int = 4
    engine: str = "torch"
    policy: str = "async"
    env: str = "CartPole-v1"
    seed: int = 0
    steps: int = 120_000
    every: int = 10
    ratio: float = 0.5  # the bottom half may be replaced: on CartPole it took fewer steps than the bottom quarter
    strategy: str = "mean"
    decide: str = "latest"  # the async policy judges a rank against every member's latest report
    explore_method: str = "perturb"  # how the explore step moves values: Ray PBT's perturbation, or PB2's model
    reference: bool = False  # rank 0 trains as a reference agent: never replaced, compared or a donor
    optimizer: str = "reset"  # a replaced agent's Adam state: a fresh one, its own kept, or its best donor's
    donors: int = 1  # the best agent donates (PBT's exploit): fewer steps on CartPole than the mean of two
    warmup: int = 20
    select_last: int = 0  # the population ranks agents by their last K episodes' mean return (0: the last 20)
    share_samples: bool = False  # each agent also learns from the others' latest rollouts (SampleSharing)
    out_dir: str = "runs"
    live: bool = True
    stop_at_target: bool = False
    checkpoint_every: int = 0  # iterations between population checkpoints (0: none)
    checkpoint_keep: int = 2  # the newest complete checkpoints kept
    resume: str = ""  # a run folder (or one of its checkpoints) to resume from
    max_restarts: int = 0  # restarts per rank (popmesh launch --max-restarts): a lost agent rejoins; MPI: of the job
    run_dir: str = ""  # the run folder, made before the launch where a restarted MPI job must find it again
    kill: str = ""  # "RANK:ITERATION": that rank's first process SIGKILLs itself there (to watch survival)
    explore: tuple[str, ...] = EXPLORED  # what PBT's explore step moves on a replaced agent (empty: nothing)
    lr_range: tuple[float, float] = LR_RANGE  # each rank's learning rate drawn log-uniformly from it
    ent_range: tuple[float, float] = ENT_RANGE  # and its entropy coefficient
    terminal: bool = False  # the user's stdout is a terminal (under mpiexec rank 0's is a pipe to it)
    baseline: str = ""  # an earlier run folder whose best agent returns.png draws beside this run
    task: str = "cartpole"  # or "hypergrid": examples/gfn_hypergrid.py, a population of GFlowNets
    nnodes: int = 1  # launchers (nodes) the world forms on (--nnodes N, or MIN of --nnodes MIN:MAX)
    max_nodes: int = 0  # MAX of --nnodes MIN:MAX: an elastic world that later launchers join (0: a fixed size)
    node_rank: int = 0  # this launcher's node (--node-rank): its ranks are numbered node_rank * ranks + local rank
    rdzv_endpoint: str = ""  # HOST:PORT where every launcher of the run meets (node 0's store)

    def __post_init__(self) -> None:
        put = object.__setattr__  # values that came through JSON (lists) become tuples
        put(self, "explore", tuple(self.explore))
        put(self, "lr_range", _range("--lr-range", self.lr_range))
        put(self, "ent_range", _range("--ent-range", self.ent_range))
        if self.env not in ENVS:
            raise ConfigError(f"--env {self.env!r}: choose one of {', '.join(ENVS)}")
        unknown = [name for name in self.explore if name not in EXPLORABLE]
        if unknown or len(set(self.explore)) != len(self.explore):
            raise ConfigError(f"--explore {','.join(self.explore)}: name each of {', '.join(EXPLORABLE)} at most "
                              "once, comma-separated (or --no-explore to explore nothing)")
        self._check_counts()
        self._check_task()
        self._check_nodes()
        if self.kill:
            self.kill_at()
        if self.baseline:
            _check_baseline(self.baseline, self.env)

    def _check_task(self) -> None:
        """``--task``: hypergrid takes the options it shares with CartPole, its own come after ``--``."""
        if self.task not in TASKS:
            raise ConfigError(f"--task {self.task!r}: choose one of {', '.join(TASKS)}")
        if self.task == "cartpole":
            return
        defaults = DemoConfig()
        given = [f"--{n.replace('_', '-')}" for n in CARTPOLE_ONLY if getattr(self, n) != getattr(defaults, n)]
        if given:
            raise ConfigError(f"{', '.join(given)}: the CartPole task's option(s); --task hypergrid takes its own "
                              "after --, e.g. popmesh demo --task hypergrid -- --iterations 600 --every 25 (python "
                              "examples/gfn_hypergrid.py --help lists them)")
        if self.policy not in ("async", "average-all", "none"):
            raise ConfigError(f"--policy {self.policy}: with --task hypergrid choose async (the default), average-all "
                              "or none")
        if self.ranks < 3:
            raise ConfigError(f"--ranks {self.ranks}: --task hypergrid needs a trainer, the replay-buffer manager and "
                              "the coordinator: 3 ranks or more (default 6, 4 of them trainers)")

    def _check_nodes(self) -> None:
        """``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``: a world over several launchers (torch engine,
        CartPole task), elastic with ``--nnodes MIN:MAX``."""
        nodes = self.max_nodes or self.nnodes
        given = self.nnodes != 1 or self.max_nodes or self.node_rank or self.rdzv_endpoint
        if not given:
            return
        if self.engine != "torch":
            raise ConfigError("--nnodes, --node-rank and --rdzv-endpoint start a torch world over several launchers; "
                              "an MPI job has a fixed size (--max-restarts restarts it whole): drop them, or "
                              "--engine mpi")
        if self.task != "cartpole":
            raise ConfigError("--nnodes, --node-rank and --rdzv-endpoint are the CartPole task's: --task hypergrid's "
                              "replay-buffer service has fixed roles on one launcher's ranks; drop them there")
        if self.nnodes < 1 or (self.max_nodes and self.max_nodes <= self.nnodes):
            raise ConfigError(f"--nnodes {self.nodes_text}: give a number of nodes, or MIN:MAX with 1 <= MIN < MAX")
        if not 0 <= self.node_rank < nodes:
            raise ConfigError(f"--node-rank {self.node_rank} is outside 0..{nodes - 1} (--nnodes {self.nodes_text}): "
                              "node 0 starts the run, and with MIN:MAX nodes MIN to MAX-1 join it later")
        if nodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nodes_text}: every launcher of the run meets at node 0; give each the "
                              "same --rdzv-endpoint HOST:PORT (node 0's address and a free port, e.g. "
                              "127.0.0.1:29560 on one host)")
        if self.elastic and (self.checkpoint_every or self.resume):
            raise ConfigError(f"--nnodes {self.nodes_text} changes the population's size, and a checkpoint holds one "
                              "agent per rank of a fixed-size world: drop --checkpoint-every and --resume, or give "
                              "--nnodes one number")

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: later launchers' ranks join the running population, and a rank lost with no
        restart left leaves it for good."""
        return self.max_nodes > 0

    @property
    def nodes_text(self) -> str:
        """``--nnodes`` as given: ``2`` or ``1:2``."""
        return f"{self.nnodes}:{self.max_nodes}" if self.max_nodes else str(self.nnodes)

    def _check_counts(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"--ranks {self.ranks}: need at least one rank")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.engine not in ("torch", "mpi"):
            raise ConfigError(f"--engine {self.engine!r}: choose torch or mpi")
        if self.steps < 1 or self.every < 1:
            raise ConfigError("--steps and --every must be positive")
        if not 0 < self.ratio <= 0.5:
            raise ConfigError(f"--ratio {self.ratio:g}: give the bottom fraction of agents that may be replaced, in "
                              "(0, 0.5] (above a half, the bottom and the top that donates would overlap)")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.decide not in ("latest", "complete"):
            raise ConfigError(f"--decide {self.decide!r}: choose latest (never wait) or complete (every rank's "
                              "report of one iteration)")
        self._check_latest_only()
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
        if self.donors < 1 or self.warmup < 0:
            raise ConfigError("--donors must be at least 1 and --warmup not negative")
        if not 0 <= self.select_last <= WINDOW:
            raise ConfigError(f"--select-last {self.select_last}: rank agents by the mean return of their last 1 to "
                              f"{WINDOW} episodes (0: the last {WINDOW}, the metric and the target's)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every}: give 0 (none) or a number of iterations")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep {self.checkpoint_keep}: keep at least the newest checkpoint (1)")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: give 0 or more")
        if self.max_restarts and self.engine == "mpi" and not self.checkpoint_every:
            raise ConfigError("--max-restarts with --engine mpi restarts the whole job (an MPI world cannot take one "
                              "rank back), which resumes from the population's newest checkpoint: add "
                              "--checkpoint-every K")

    def _check_latest_only(self) -> None:
        latest = self.policy == "async" and self.decide == "latest"
        if self.explore_method not in ("perturb", "pb2"):
            raise ConfigError(f"--explore-method {self.explore_method!r}: choose perturb (Ray PBT's) or pb2 "
                              "(PB2's model)")
        if self.explore_method == "pb2" and not (latest and self.explore):
            raise ConfigError("--explore-method pb2 models the population's reports on the coordinator: it needs "
                              "--policy async --decide latest and something to --explore")
        if self.reference and not (latest and self.ranks >= 3):
            raise ConfigError("--reference needs --policy async --decide latest and at least 3 --ranks (rank 0 trains "
                              "alone; the others select among themselves)")

    @property
    def library_explores(self) -> bool:
        """The population policy assigns a replaced agent's explored values (its donor's, explored by the
        coordinator): the asynchronous policy deciding on the latest reports. Otherwise the worker
        explores the values that came with the weights itself."""
        return self.policy == "async" and self.decide == "latest" and bool(self.explore)

    @property
    def target(self) -> float:
        """The mean return over an agent's last 20 episodes that counts as solving ``env``."""
        return ENVS[self.env]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def kill_at(self) -> tuple[int, int] | None:
        """``--kill RANK:ITERATION`` as numbers (None without it). RANK is the launcher's number for the rank
        (``world.roster[world.rank]``): the rank itself until an elastic world renumbers its ranks."""
        if not self.kill:
            return None
        rank, _, iteration = self.kill.partition(":")
        agents = self.ranks * (self.max_nodes or self.nnodes)  # launcher numbers: node_rank * ranks + local rank
        if not (rank.isdigit() and iteration.isdigit()) or int(rank) >= agents:
            below = "--ranks" if agents == self.ranks else f"--ranks times the nodes ({agents})"
            raise ConfigError(f"--kill {self.kill!r}: give RANK:ITERATION with RANK (a launcher's number for its rank) "
                              f"below {below}, e.g. --kill 1:60")
        return int(rank), int(iteration)

    def declarations(self) -> dict[str, Continuous]:
        """The explored hyper-parameters' spaces: log-uniform over ``--lr-range`` and ``--ent-range``."""
        return declarations(self.lr_range, self.ent_range)


def _range(option: str, value: Any) -> tuple[float, float]:
    """``(low, high)`` from a pair, with the option named when it is not ``0 < low < high``."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} {value!r}: give LOW:HIGH, e.g. {option} 1e-4:1e-2") from None
    if not (0 < low < high and math.isfinite(high)):
        raise ConfigError(f"{option} {low:g}:{high:g}: give 0 < LOW < HIGH (the values are drawn log-uniformly), "
                          f"e.g. {option} 1e-4:1e-2")
    return low, high


def parse_range(option: str, text: str) -> tuple[float, float]:
    """``"1e-5:1e-1"`` as ``(1e-5, 1e-1)``; a ConfigError naming ``option`` for anything else."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        pair = (float(low), float(high))
    except ValueError:
        raise ConfigError(f"{option} {text!r}: give LOW:HIGH, e.g. {option} 1e-4:1e-2") from None
    return _range(option, pair)


def parse_explore(text: str) -> tuple[str, ...]:
    """``"lr,ent_coef"`` as ``("lr", "ent_coef")`` (checked by :class:`DemoConfig`)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _check_baseline(run: str, env: str) -> None:
    """ConfigError when ``run`` has no history, or trained another task than ``env``."""
    import json

    folder = history_file(run).parent
    summary = folder / "summary.json"
    trained = json.loads(summary.read_text()).get("config", {}).get("env", "CartPole-v1") if summary.is_file() else env
    if trained != env:
        raise ConfigError(f"--baseline {run}: that run trained on {trained}, this one on {env}: give a run of the "
                          f"same --env, or --env {trained}")


def rank_seed(seed: int, rank: int) -> int:
    """Distinct, reproducible seeds per rank."""
    return int(seed) * 1000 + rank


def declarations(lr_range: tuple[float, float] = LR_RANGE,
                 ent_range: tuple[float, float] = ENT_RANGE) -> dict[str, Continuous]:
    """The explored hyper-parameters, each log-uniform over its range (the draw, the explore step's
    resampling space and its bounds)."""
    return {"lr": Continuous(*lr_range, log=True), "ent_coef": Continuous(*ent_range, log=True)}


def initial_hyper(seed: int, rank: int, lr_range: tuple[float, float] = LR_RANGE,
                  ent_range: tuple[float, float] = ENT_RANGE) -> dict[str, float]:
    """Rank ``rank``'s starting learning rate and entropy coefficient, drawn log-uniformly from the
    ranges, seeded by (seed, rank): the same on every run, different per rank."""
    drawn = sample_hparams(declarations(lr_range, ent_range), np.random.default_rng([seed, rank, 7]))
    return {name: float(value) for name, value in drawn.items()}


def rank_hyper(seed: int, rank: int, lr_range: tuple[float, float] = LR_RANGE,
               ent_range: tuple[float, float] = ENT_RANGE) -> Hyper:
    """Each rank's hyper-parameters: :func:`initial_hyper`, so the population has good and bad agents
    to tell apart."""
    drawn = initial_hyper(seed, rank, lr_range, ent_range)
    return Hyper(lr=drawn["lr"], entropy=drawn["ent_coef"])


def explore_hyper(values: dict[str, float], names: tuple[str, ...], space: dict[str, Continuous], seed: int,
                  rank: int, iteration: int) -> dict[str, float]:
    """PBT's explore step for a replaced agent's inherited values, as Ray Tune's defaults do it: each of
    ``names`` resampled from its space with probability 0.25, else multiplied by 0.8 or 1.2, kept within
    its bounds; the others kept. Seeded by (seed, rank, iteration), so a run is reproducible."""
    moved = {name: min(max(values[name], space[name].low), space[name].high) for name in names}
    gen = np.random.default_rng([seed, rank, iteration, 11])
    new = pbt_explore(moved, gen, perturb=(0.8, 1.2), resample_prob=0.25, space={n: space[n] for n in names})
    return {**values, **{name: float(value) for name, value in new.items()}}
