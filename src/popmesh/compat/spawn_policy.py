"""``spawn_policy`` (torchgfn's multinode example) over :mod:`popmesh.population`.

Same class names, constructor and ``__call__`` parameters (order, defaults) as the original; each
call returns ``(model, optimizer, info)`` with torchgfn's info keys plus ``"policy_info"`` (a
:class:`~popmesh.population.PolicyInfo`). ``group`` is one of a context's groups or a popmesh
``Group``; the defaults ``dist.group.WORLD`` / ``MPI.COMM_WORLD`` are sentinels meaning "the current
world", started on first use under a launcher (importing this module starts nothing). Mapping:
``AverageAllPolicy*`` → ``AverageAll``, ``AsyncSelectiveAveragingPolicy`` →
``AsyncSelectiveAveraging``, ``_compute_worst_ranks_by_ratio`` → ``worst_by_ratio``. The one-sided
``...mpi4pyFast``/``General`` decide as torchgfn does (per-rank ages and lifetimes from Python's
``random``, the metric threshold, a blocking gather of metrics every ``average_every`` iterations
for ``worst_ratio``; ``max(1, int(n * 0.5))`` random donors among the other ranks) and move the
weights through popmesh's snapshot windows: the MPI engine's, or those of a torch world's mpi4py side
under mpiexec (``ctx.dc_mpi4py``); without MPI the constructor's ConfigError says how to launch.

Where popmesh deliberately behaves differently from torchgfn (its bugs fixed; docs/migrating.md):

* averaged weights are applied (torchgfn's async policy computed and dropped them since
  ``af0a0483``); the coordinator (group rank 0 by default) may donate or be replaced without deadlock;
  ``weighted_mean`` favours better donors and accepts negative metrics (torchgfn weighted by
  ``1/metric``); ``momentum`` is applied (``momentum·own + (1-momentum)·combined``); the group's
  ranks and size are used, not the world's (``AverageAllPolicy`` divided by the world size);
* one-sided reads are tear-free snapshots (torchgfn locked each tensor separately), every
  parameter is averaged (General kept 0-d ones fresh) and ``averaging_strategy``/``momentum`` are
  honoured (torchgfn ignored them; Fast raised for any strategy but ``mean``); a group of one
  replaces nobody (torchgfn raised finding no donor); a non-finite metric is below any threshold;
* weights are written into the caller's model in place and the optimizer's state is cleared
  (torchgfn built a new model and optimizer with ``model_builder()``, also discarding the state);
  ``model_builder`` (returning a model or ``(model, optimizer)``) only supplies fresh weights for
  ``reset_weights``; the returned objects are the caller's;
* the async policy replaces the ``max(1, floor(n·ratio))`` worst, keeping at least one rank;
  with a ``threshold`` only those of them below it (``+inf``: all), and ``cooldown`` protects
  each recently replaced rank (torchgfn: one global cooldown); NaN metrics count as worst; a
  decision iteration needs ``local_metric`` on every rank (ConfigError; torchgfn stalled).

The async policy's newer parameters (torchgfn after the seed document): ``coordinator_group_rank`` and
``participant_group_ranks`` are group ranks of the call's ``group``; popmesh's policy runs over the
participants alone, the others get their model back untouched, and a coordinator outside the participants
serves them from a thread of its own (``coordinate()``) until each has shut down. Invalid or empty ranks
are ConfigError naming the argument and the group's size (torchgfn: ValueError). They come after
``cooldown`` as in torchgfn, so ``timing`` is no longer the ninth positional parameter; torchgfn's
``num_training_ranks`` (its third, where the seed has ``replacement_ratio``) is keyword-only and, as
there, replaced by the number of participants.
"""

from __future__ import annotations

import abc
import logging
import math
import random
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from popmesh.comm.collectives import all_gather
from popmesh.comm.world import Comm, current_world, init, resolve_group
from popmesh.compat._mpi_side import side_comm
from popmesh.compat._native import comm_of, native_of
from popmesh.compat._spawn_members import Membership
from popmesh.compat._windows import Exposure, replace_from, window_opener
from popmesh.core.errors import ConfigError
from popmesh.population import (
    AsyncSelectiveAveraging,
    AverageAll,
    PolicyInfo,
    ReplacementRule,
    SelectiveOptions,
    Strategy,
    worst_by_ratio,
)
from popmesh.population.mechanisms.info import Clock

__all__ = [
    "AsyncSelectiveAveragingPolicy",
    "AsyncSelectiveAveragingPolicympi4pyFast",
    "AsyncSelectiveAveragingPolicympi4pyGeneral",
    "AverageAllPolicy",
    "AverageAllPolicympi4py",
    "SpawnPolicy",
    "logger",
]

__newer__ = {  # what torchgfn's multinode example added since the seed document: parameters with defaults
    "AsyncSelectiveAveragingPolicy": ("coordinator_group_rank", "participant_group_ranks", "num_training_ranks"),
}

logger = logging.getLogger(__name__)
_R = TypeVar("_R")
_EDGE = 1e-6  # ratio 0 and 1 of the original mean "one rank" and "all but one"


class _CurrentWorld:
    """The default ``group``: whatever world is current when the policy is called."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __repr__(self) -> str:
        return f"<the current world ({self.__name__})>"


_WORLD = _CurrentWorld("WORLD")  # torchgfn: dist.group.WORLD
_COMM_WORLD = _CurrentWorld("COMM_WORLD")  # torchgfn: MPI.COMM_WORLD


def _group(group: Any) -> Comm | None:
    """``group`` as popmesh's, None for the current world, which is started here when this process
    was launched as part of a job and nothing has started it yet (as the gfn and omnisafe facades do)."""
    if group is None or isinstance(group, _CurrentWorld):
        try:
            current_world()
        except ConfigError:
            init()
        return None
    comm = comm_of(group)
    if comm is None:
        raise ConfigError(f"group must be a context's group (e.g. ctx.train_global_group) or a popmesh Group, "
                          f"not {type(group).__name__}")
    return comm


def _ratio(ratio: float) -> float:
    """torchgfn's closed [0, 1] as popmesh's open (0, 1), with the same counts at the ends (the
    async policy's check: ConfigError, a ValueError as torchgfn's, outside [0, 1])."""
    if not 0.0 <= float(ratio) <= 1.0:
        raise ConfigError(f"replacement_ratio must lie in [0, 1], got {ratio!r}")
    return _clamped(ratio)


def _clamped(ratio: float) -> float:
    """Any ratio as popmesh's open (0, 1) with torchgfn's counts: at least one rank, at most n - 1."""
    return min(max(float(ratio), _EDGE), 1.0 - _EDGE)


def _builder(model_builder: Any) -> Any:
    def build() -> Any:
        built = model_builder()
        return built[0] if isinstance(built, (tuple, list)) else built

    return build


def _compute_worst_ranks_by_ratio(metrics: list[float], replacement_ratio: float) -> set[int]:
    """Return the set of globally worst ranks to replace: ``max(1, floor(n·ratio))`` lowest
    metrics, at most ``n - 1`` (empty for ``n <= 1``); a ratio outside [0, 1] is clamped, as in
    torchgfn. Ties: the higher rank first; NaN is worst."""
    return set(worst_by_ratio(metrics, _clamped(replacement_ratio))) if len(metrics) > 1 else set()


def _parameters_not_inherited(method: Callable[..., _R]) -> Callable[..., _R]:
    """``method`` unchanged; type checkers keep only its return type. torchgfn's policies do not take
    the parameters of SpawnPolicy's abstract ``__call__`` (they add ``optimizer`` after ``model``, the
    one-sided ones ``expose_params`` too), which the facade copies as they are."""
    return method


class SpawnPolicy(abc.ABC):
    """Base of the spawn policies: ``average_every = max(int(average_every), 1)``."""

    def __init__(self, average_every: int) -> None:
        self.average_every = max(int(average_every), 1)

    @_parameters_not_inherited
    @abc.abstractmethod
    def __call__(self, iteration: int, model: Any, local_metric: float | None = None,
                 group: Any = _WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration (concrete policies also take
        ``optimizer`` after ``model``)."""


class AverageAllPolicy(SpawnPolicy):
    """Standard model averaging across all ranks of ``group`` every N iterations (divides by the
    group's size). Every member calls on the same iterations; runs on every engine."""

    def __init__(self, average_every: int) -> None:
        super().__init__(average_every)
        self._policy = AverageAll(self.average_every)

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float | None = None,
                 group: Any = _WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration."""
        model, optimizer, info = self._policy(iteration, model, optimizer, local_metric, _group(group))
        return model, optimizer, {"averaged_this_iteration": info.averaged, "policy_info": info}


class AverageAllPolicympi4py(AverageAllPolicy):
    """Standard model averaging across all ranks every N iterations (needs no torch process group;
    torchgfn's did nothing without one)."""

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float | None = None,
                 group: Any = _COMM_WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration."""
        return super().__call__(iteration, model, optimizer, local_metric, group)


class AsyncSelectiveAveragingPolicy(SpawnPolicy):
    """Asynchronous selective averaging with background, non-blocking comms: once every participant has
    reported iteration t, the coordinator decides from every participant's metric (popmesh's
    ``decide="complete"``), donors stream their weights, and a replaced rank applies them at its next
    call (``info["averaged_this_iteration"]``). ``coordinator_group_rank`` and ``participant_group_ranks``
    are group ranks of the ``group`` passed to the call (default: group rank 0, every rank); only the
    participants report, donate and are replaced; a coordinator outside them serves them from a thread of
    its own. Every rank of the group calls the policy and :meth:`shutdown`."""

    def __init__(self, model_builder: Any, average_every: int, replacement_ratio: float = 0.2,
                 averaging_strategy: str = "mean", momentum: float = 0.0, poll_interval_s: float = 0.01,
                 threshold: float | None = None, cooldown: int = 200, coordinator_group_rank: int = 0,
                 participant_group_ranks: list[int] | None = None, timing: Any = None, *,
                 num_training_ranks: int | None = None) -> None:
        super().__init__(average_every)
        self.replacement_ratio, self.averaging_strategy, self.momentum = replacement_ratio, averaging_strategy, momentum
        self.poll_interval_s, self.threshold, self.cooldown, self.timing = poll_interval_s, threshold, cooldown, timing
        self.coordinator_group_rank, self.participant_group_ranks = coordinator_group_rank, participant_group_ranks
        self._membership = Membership(coordinator_group_rank, participant_group_ranks, num_training_ranks)
        if threshold is None:
            rule = ReplacementRule(ratio=_ratio(replacement_ratio))
        else:
            limit = sys.float_info.max if threshold == math.inf else threshold
            rule = ReplacementRule(ratio=_ratio(replacement_ratio), threshold=limit, cooldown=cooldown, mode="all")
        self._policy = AsyncSelectiveAveraging(self.average_every, decide="complete", poll_interval=poll_interval_s,
                                               rule=rule, strategy=averaging_strategy, momentum=momentum,
                                               model_builder=_builder(model_builder))

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float | None = None,
                 group: Any = _WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration."""
        membership, comm = self._membership, resolve_group(_group(group))
        comm.require_member(type(self).__name__)
        members, taking_part = membership.resolve(comm, self._policy)
        if membership.serving is not None:
            membership.serving.surface()
        if taking_part.rank not in members.participants:
            info = PolicyInfo(int(iteration), self._policy.name, summary="not a participant")
            return model, optimizer, {"averaged_this_iteration": False, "policy_info": info}
        model, optimizer, info = self._policy(iteration, model, optimizer, local_metric, taking_part)
        return model, optimizer, {"averaged_this_iteration": info.replaced, "policy_info": info}

    @property
    def num_training_ranks(self) -> int | None:
        """How many ranks take part (torchgfn's count; known from the first call on)."""
        return self._membership.num_training_ranks

    def shutdown(self) -> None:
        """Stop the background thread after a handshake with the coordinator (on a coordinator outside the
        participants: once every participant has shut down)."""
        self._membership.shutdown(self._policy)


class _OneSided(SpawnPolicy):
    """What the two MPI one-sided policies share; see AsyncSelectiveAveragingPolicympi4pyFast."""

    _MODES = ("age", "threshold", "worst_ratio")

    def _setup(self, model_builder: Any, model: Any, threshold_metric: float, replacement_ratio: float,
               averaging_strategy: str, momentum: float, age_range: tuple[int, int], replacement_mode: str,
               group: Any) -> None:
        if replacement_mode not in self._MODES:
            raise ConfigError(f"Unknown replacement_mode: {replacement_mode}. Expected one of: age, threshold, "
                              "worst_ratio.")
        self._comm = resolve_group(_group(group))
        if self._comm.size > 1:
            window_opener(self._comm)  # no MPI windows here: the ConfigError that says how to launch, now
        self.train_comm_group = side_comm(self._comm) or native_of(self._comm)
        self.myrank, self.comm_size = self._comm.group_rank, self._comm.size
        self.threshold_metric, self.replacement_ratio = float(threshold_metric), float(replacement_ratio)
        self.averaging_strategy, self.momentum = str(averaging_strategy), float(momentum)
        self.replacement_mode = str(replacement_mode)
        self._model_builder, self._model = model_builder, model
        self._options = SelectiveOptions(1, strategy=Strategy.parse(averaging_strategy), momentum=momentum,
                                         model_builder=_builder(model_builder))
        self._exposure: Exposure | None = None
        self._expose = False
        self.timing: dict[str, float] = {}
        self.stats: dict[str, list[int]] = {}
        self.agents_killed = self.averaging_ranks = self._count = self.total_iterations = self.num_replacements = 0
        self.debug_mode = False
        self.age, self.age_range = 0, (*age_range,)
        self.max_age = random.randint(self.age_range[0], self.age_range[1])

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float,
                 expose_params: bool = True, group: Any = _COMM_WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly replace this agent on this iteration; the first call is collective (windows)."""
        self._check_group(group)
        metric = math.nan if local_metric is None else float(local_metric)
        if not self._expose:
            self._ensure_initialized(model, iteration, metric)
        self._count += 1
        self.total_iterations += 1
        self._model = model
        clock = Clock()
        should_replace, all_metrics = self._should_replace(iteration, local_metric)
        clock.lap("decide")
        info = PolicyInfo(int(iteration), "one_sided", acted=True, decision_iteration=int(iteration),
                          strategy=self._options.strategy.value)
        if all_metrics is not None:
            info.metrics = dict(zip(self._comm.ranks, all_metrics))
        if should_replace and self.comm_size > 1:  # a group of one has nobody to read from
            optimizer = self._replace(iteration, model, optimizer, info, clock)
        if expose_params and self._exposure is not None:
            self._exposure.publish(model, iteration, metric)
            clock.lap("publish")
        info.timings = clock.laps
        for name, seconds in clock.laps.items():
            self.timing[name] = self.timing.get(name, 0.0) + seconds
        out = {"averaged_this_iteration": info.replaced, "replacement_mode": self.replacement_mode,
               "is_replaced": info.replaced, "num_replacements_so_far": self.num_replacements,
               "local_metric": None if local_metric is None else float(local_metric),
               "replacement_check_every": self.average_every, "policy_info": info}
        if all_metrics:
            out["global_min_metric"], out["global_max_metric"] = float(min(all_metrics)), float(max(all_metrics))
        return model, optimizer, out

    def _check_group(self, group: Any) -> None:
        comm = _group(group)
        if comm is not None and comm.ranks != self._comm.ranks:
            raise ConfigError(f"this policy works over ranks {list(self._comm.ranks)} (its constructor's group); "
                              f"the call passed ranks {list(comm.ranks)}: pass group= to the constructor")

    def _ensure_initialized(self, model: Any, iteration: int = 0, metric: float = math.nan) -> None:
        """Create the window and publish ``model`` (collective over the group)."""
        self._model = model
        if self.comm_size > 1:
            self._exposure = Exposure(self._comm, model, iteration, metric)
        self._expose = True

    def reset_age(self) -> None:
        """Start a new life: age 0 and a new lifetime drawn from ``age_range`` (Python's ``random``)."""
        self.max_age = random.randint(self.age_range[0], self.age_range[1])
        self.age = 0

    def _dying(self, local_metric: float, threshold_metric: float, check: int) -> bool:
        if check == 0:  # threshold; non-finite counts as dying
            if local_metric is None:
                raise ConfigError("replacement_mode='threshold' compares local_metric with threshold_metric at "
                                  "every call: pass local_metric (higher is better)")
            return not float(local_metric) >= float(threshold_metric) or not math.isfinite(float(local_metric))
        if check == 1:  # age: dies once its age has reached its lifetime, then starts a new life
            if self.age >= self.max_age:
                self.reset_age()
                return True
            self.age += 1
            return False
        raise ConfigError(f"Unknown is_agent_dying version: {check} (0: threshold, 1: age)")

    def _is_worst_rank_this_iteration(self, iteration: int, local_metric: float) -> tuple[bool, list[float] | None]:
        """On every ``average_every``-th iteration (0 included): gather every rank's metric (blocking,
        collective over the group) and say whether this rank is among the worst by ratio."""
        if iteration % self.average_every != 0:
            return False, None
        value = math.nan if local_metric is None else float(local_metric)
        gathered = all_gather(np.array([value], dtype=np.float64), group=self._comm)
        all_metrics = [float(m) for m in np.asarray(gathered).reshape(-1)]
        return self.myrank in _compute_worst_ranks_by_ratio(all_metrics, self.replacement_ratio), all_metrics

    def _should_replace(self, iteration: int, local_metric: float) -> tuple[bool, list[float] | None]:
        """Whether this rank is replaced now, and the gathered metrics (``worst_ratio`` decisions)."""
        if self.replacement_mode == "age":
            return self._dying(local_metric, self.threshold_metric, 1), None
        if self.replacement_mode == "threshold":
            return self._dying(local_metric, self.threshold_metric, 0), None
        return self._is_worst_rank_this_iteration(iteration, local_metric)

    def _get_donors(self, n: int, k: int, d: int) -> list[int]:
        """``k`` distinct group ranks of ``0..n-1`` other than ``d``, drawn with Python's ``random``."""
        if k > n - 1:
            raise ConfigError(f"k must be ≤ n-1 when excluding one value (k={k}, n={n})")
        return random.sample([x for x in range(n) if x != d], k)

    def _replace(self, iteration: int, model: Any, optimizer: Any, info: PolicyInfo, clock: Clock) -> Any:
        assert self._exposure is not None  # made by the first call in a group of two or more
        donors = self._get_donors(self.comm_size, max(1, int(self.comm_size * 0.5)), self.myrank)
        self.num_replacements += 1
        self.agents_killed += 1
        self.averaging_ranks = len(donors)
        self.capture_comm("donors", len(donors))
        optimizer, info.weights, info.optimizer = replace_from(self._exposure, donors, self._options, model,
                                                               optimizer, iteration, clock)
        info.replaced, info.donors = True, tuple(self._comm.ranks[d] for d in donors)
        return optimizer

    def capture_comm(self, name: str, size: int) -> None:
        """Record ``size`` under ``name`` (see :meth:`print_stats`)."""
        self.stats.setdefault(name, []).append(int(size))

    def print_stats(self) -> None:
        """Print replacements and the recorded statistics of this rank (min, max, mean, count)."""
        print(f"rank {self.myrank}: {self.num_replacements} replacements in {self.total_iterations} calls", flush=True)
        for name, values in self.stats.items():
            print(f"rank {self.myrank} - stat {name}: min={min(values)}, max={max(values)}, "
                  f"avg={sum(values) / len(values):.6f}, count={len(values)}", flush=True)

    def print_time(self) -> None:
        """Print the seconds this rank spent in each phase of the policy."""
        print(f"rank {self.myrank}: policy time {self.timing}", flush=True)

    def shutdown(self) -> None:
        """Free the window; collective over the group."""
        if self._exposure is not None:
            self._exposure.close()


class AsyncSelectiveAveragingPolicympi4pyFast(_OneSided):
    """Asynchronous selective averaging over MPI one-sided windows: a dying rank reads random donors'
    published weights (one tear-free snapshot each) and combines them; donors take no part."""

    def __init__(self, model_builder: Any, model: Any, average_every: int, threshold_metric: float = 0.0,
                 replacement_ratio: float = 0.2, averaging_strategy: str = "mean", momentum: float = 0.0,
                 age_range: tuple[int, int] = (50, 150), replacement_mode: str = "age",
                 group: Any = _COMM_WORLD) -> None:
        super().__init__(average_every)
        self._setup(model_builder, model, threshold_metric, replacement_ratio, averaging_strategy, momentum,
                    age_range, replacement_mode, group)

    def is_agent_dying(self, local_metric: float, threshold_metric: float, check_policy: int = 0) -> bool:
        """``check_policy=0``: ``local_metric`` below ``threshold_metric`` (non-finite: dying);
        ``1``: this agent's age reached its lifetime (which starts a new life)."""
        return self._dying(local_metric, threshold_metric, check_policy)


class AsyncSelectiveAveragingPolicympi4pyGeneral(_OneSided):
    """As :class:`AsyncSelectiveAveragingPolicympi4pyFast` (popmesh uses one window for both);
    ``poll_interval_s`` is accepted and, as in torchgfn, unused."""

    def __init__(self, model_builder: Any, model: Any, average_every: int, threshold_metric: float = 0.0,
                 replacement_ratio: float = 0.2, averaging_strategy: str = "mean", momentum: float = 0.0,
                 poll_interval_s: float = 0.01, age_range: tuple[int, int] = (50, 150),
                 replacement_mode: str = "age", group: Any = _COMM_WORLD) -> None:
        super().__init__(average_every)
        self.poll_interval_s = poll_interval_s
        self._setup(model_builder, model, threshold_metric, replacement_ratio, averaging_strategy, momentum,
                    age_range, replacement_mode, group)

    def is_agent_dying(self, local_metric: float, threshold_metric: float, check_agent: int = 0) -> bool:
        """``check_agent=0``: ``local_metric`` below ``threshold_metric`` (non-finite: dying);
        ``1``: this agent's age reached its lifetime (which starts a new life)."""
        return self._dying(local_metric, threshold_metric, check_agent)
