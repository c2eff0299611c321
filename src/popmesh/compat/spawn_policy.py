"""``spawn_policy`` (torchgfn's multinode example) over :mod:`popmesh.population`.

Same class names, constructor and ``__call__`` parameters (order, defaults) as the original; each
call returns ``(model, optimizer, info)`` with torchgfn's info keys plus ``"policy_info"`` (the
:class:`~popmesh.population.PolicyInfo`). ``group`` is a popmesh ``Group``/``World``; the defaults
``dist.group.WORLD`` / ``MPI.COMM_WORLD`` are sentinels meaning "the current world" (importing
this module starts no engine). Mapping: ``AverageAllPolicy*`` → ``AverageAll``,
``AsyncSelectiveAveragingPolicy`` → ``AsyncSelectiveAveraging``, ``...mpi4pyFast``/``General``
→ ``OneSidedAveraging`` (the MPI engine only), ``_compute_worst_ranks_by_ratio`` →
``worst_by_ratio``.

Where popmesh deliberately behaves differently from torchgfn (its bugs fixed):

* averaged weights are applied (torchgfn's async policy computed and dropped them since
  ``af0a0483``); the coordinator (rank 0) may donate or be replaced without deadlock;
  ``weighted_mean`` favours better donors and accepts negative metrics (torchgfn weighted by
  ``1/metric``); ``momentum`` is applied (``momentum·own + (1-momentum)·combined``); the group's
  ranks and size are used, not the world's (``AverageAllPolicy`` divided by the world size);
* one-sided reads are tear-free snapshots (torchgfn locked each tensor separately), and
  ``averaging_strategy``/``momentum`` are honoured there too (torchgfn ignored them);
* weights are written into the caller's model in place and the optimizer's state is cleared
  (torchgfn built a new model and optimizer with ``model_builder()``, also discarding the state);
  ``model_builder`` (returning a model or ``(model, optimizer)``) only supplies fresh weights for
  ``reset_weights``; the returned objects are the caller's;
* the async policy replaces the ``max(1, floor(n·ratio))`` worst, keeping at least one rank;
  with a ``threshold`` only those of them below it (``+inf``: all), and ``cooldown`` protects
  each recently replaced rank (torchgfn: one global cooldown); NaN metrics count as worst;
* a decision iteration needs ``local_metric`` on every rank (ConfigError; torchgfn silently
  stalled); age and threshold modes decide on every call (as torchgfn), ``worst_ratio`` every
  ``average_every`` iterations from published metrics rather than a blocking allgather; donors are
  ``max(1, n // 2)`` random ranks among those not replaced.
"""

from __future__ import annotations

import abc
import logging
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from popmesh.comm.world import Comm, current_world, init, resolve_group
from popmesh.compat._native import comm_of
from popmesh.core.errors import ConfigError
from popmesh.population import (
    AsyncSelectiveAveraging,
    AverageAll,
    DonorRule,
    OneSidedAveraging,
    PolicyInfo,
    ReplacementRule,
    worst_by_ratio,
)
from popmesh.population.options import due

__all__ = [
    "AsyncSelectiveAveragingPolicy",
    "AsyncSelectiveAveragingPolicympi4pyFast",
    "AsyncSelectiveAveragingPolicympi4pyGeneral",
    "AverageAllPolicy",
    "AverageAllPolicympi4py",
    "SpawnPolicy",
    "logger",
]

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
    """torchgfn's closed [0, 1] as popmesh's open (0, 1), with the same counts at the ends."""
    if not 0.0 <= float(ratio) <= 1.0:
        raise ConfigError(f"replacement_ratio must lie in [0, 1], got {ratio!r}")
    return min(max(float(ratio), _EDGE), 1.0 - _EDGE)


def _builder(model_builder: Any) -> Any:
    def build() -> Any:
        built = model_builder()
        return built[0] if isinstance(built, (tuple, list)) else built

    return build


def _compute_worst_ranks_by_ratio(metrics: list[float], replacement_ratio: float) -> set[int]:
    """Return the set of globally worst ranks to replace: ``max(1, floor(n·ratio))`` lowest
    metrics, at most ``n - 1`` (empty for ``n <= 1``). Ties: the higher rank first; NaN is worst."""
    return set(worst_by_ratio(metrics, _ratio(replacement_ratio))) if len(metrics) > 1 else set()


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
    """Asynchronous selective averaging with background, non-blocking comms: the group's first rank
    decides from every rank's metric, donors stream their weights, and a replaced rank applies them
    at its next call (``info["averaged_this_iteration"]``). Call :meth:`shutdown` on every rank."""

    def __init__(self, model_builder: Any, average_every: int, replacement_ratio: float = 0.2,
                 averaging_strategy: str = "mean", momentum: float = 0.0, poll_interval_s: float = 0.01,
                 threshold: float | None = None, cooldown: int = 200, timing: Any = None) -> None:
        super().__init__(average_every)
        self.replacement_ratio, self.averaging_strategy, self.momentum = replacement_ratio, averaging_strategy, momentum
        self.poll_interval_s, self.threshold, self.cooldown, self.timing = poll_interval_s, threshold, cooldown, timing
        if threshold is None:
            rule = ReplacementRule(ratio=_ratio(replacement_ratio))
        else:
            limit = sys.float_info.max if threshold == math.inf else threshold
            rule = ReplacementRule(ratio=_ratio(replacement_ratio), threshold=limit, cooldown=cooldown, mode="all")
        self._policy = AsyncSelectiveAveraging(self.average_every, poll_interval=poll_interval_s, rule=rule,
                                               strategy=averaging_strategy, momentum=momentum,
                                               model_builder=_builder(model_builder))

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float | None = None,
                 group: Any = _WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration."""
        model, optimizer, info = self._policy(iteration, model, optimizer, local_metric, _group(group))
        return model, optimizer, {"averaged_this_iteration": info.replaced, "policy_info": info}

    def shutdown(self) -> None:
        """Stop the background thread after a handshake with the coordinator."""
        self._policy.shutdown()


class _OneSided(SpawnPolicy):
    """What the two MPI one-sided policies share; see AsyncSelectiveAveragingPolicympi4pyFast."""

    _MODES = ("age", "threshold", "worst_ratio")

    def _setup(self, model_builder: Any, threshold_metric: float, replacement_ratio: float, averaging_strategy: str,
               momentum: float, age_range: tuple[int, int], replacement_mode: str, group: Any) -> None:
        if replacement_mode not in self._MODES:
            raise ConfigError(f"replacement_mode={replacement_mode!r}: use one of {list(self._MODES)}")
        comm = resolve_group(_group(group))
        self.train_comm_group, self.comm_size, self.myrank = comm, comm.size, comm.rank
        self.threshold_metric, self.replacement_ratio, self.averaging_strategy = (threshold_metric, replacement_ratio,
                                                                                averaging_strategy)
        self.momentum, self.age_range, self.replacement_mode = momentum, (*age_range,), replacement_mode
        self.age = self.agents_killed = self.num_replacements = self.total_iterations = self.averaging_ranks = 0
        self.max_age: int | None = None  # lifetimes are drawn by popmesh's age rule (seeded, per rank)
        self.debug_mode = False
        self.stats: dict[str, list[int]] = {}
        self.timing: dict[str, float] = {}
        rule = {"age": lambda: ReplacementRule(age_range=self.age_range),
                "threshold": lambda: ReplacementRule(threshold=float(threshold_metric)),
                "worst_ratio": lambda: ReplacementRule(ratio=_ratio(replacement_ratio))}[replacement_mode]()
        every = self.average_every if replacement_mode == "worst_ratio" else 1
        self._policy = OneSidedAveraging(every, rule=rule, donor_rule=DonorRule("random", k=max(1, comm.size // 2)),
                                         strategy=averaging_strategy, momentum=momentum,
                                         model_builder=_builder(model_builder))

    def __call__(self, iteration: int, model: Any, optimizer: Any, local_metric: float,
                 expose_params: bool = True, group: Any = _COMM_WORLD) -> tuple[Any, Any, dict[str, Any]]:
        """Possibly perform a spawn/averaging step on this iteration; the first call is collective."""
        comm = _group(group) or self.train_comm_group
        self.total_iterations += 1
        self.age += 1
        if due(iteration, self._policy.options.every):
            model, optimizer, info = self._policy(iteration, model, optimizer, local_metric, comm)
        else:
            if expose_params:
                self._policy.publish(iteration, model, optimizer, local_metric, comm)
            info = PolicyInfo(int(iteration), self._policy.name)
        return model, optimizer, self._info(info, local_metric)

    def _info(self, info: PolicyInfo, local_metric: float) -> dict[str, Any]:
        for name, seconds in info.timings.items():
            self.timing[name] = self.timing.get(name, 0.0) + seconds
        if info.replaced:
            self.num_replacements += 1
            self.agents_killed += 1
            self.averaging_ranks = len(info.donors)
            self.reset_age()
        out = {"averaged_this_iteration": info.replaced, "replacement_mode": self.replacement_mode,
               "is_replaced": info.replaced, "num_replacements_so_far": self.num_replacements,
               "local_metric": local_metric, "replacement_check_every": self.average_every, "policy_info": info}
        if self.replacement_mode == "worst_ratio" and info.metrics:
            out["global_min_metric"], out["global_max_metric"] = min(info.metrics.values()), max(info.metrics.values())
        return out

    def capture_comm(self, name: str, size: int) -> None:
        """Record ``size`` bytes of communication under ``name`` (see :meth:`print_stats`)."""
        self.stats.setdefault(name, []).append(int(size))

    def print_stats(self) -> None:
        """Print replacements and the recorded communication volume of this rank."""
        print(f"rank {self.myrank}: {self.num_replacements} replacements in {self.total_iterations} calls; "
              f"comm {{name: bytes}} {({k: sum(v) for k, v in self.stats.items()})}", flush=True)

    def print_time(self) -> None:
        """Print the seconds this rank spent in each phase of the policy."""
        print(f"rank {self.myrank}: policy time {self.timing}", flush=True)

    def reset_age(self) -> None:
        """Restart this rank's age counter (the decision itself uses popmesh's age rule)."""
        self.age = 0

    def shutdown(self) -> None:
        """Free the windows; collective over the group."""
        self._policy.close()


class AsyncSelectiveAveragingPolicympi4pyFast(_OneSided):
    """Asynchronous selective averaging over MPI one-sided windows: a rank due for replacement
    reads random donors' published weights (one tear-free snapshot each) and combines them."""

    def __init__(self, model_builder: Any, model: Any, average_every: int, threshold_metric: float = 0.0,
                 replacement_ratio: float = 0.2, averaging_strategy: str = "mean", momentum: float = 0.0,
                 age_range: tuple[int, int] = (50, 150), replacement_mode: str = "age",
                 group: Any = _COMM_WORLD) -> None:
        super().__init__(average_every)
        self._setup(model_builder, threshold_metric, replacement_ratio, averaging_strategy, momentum, age_range,
                    replacement_mode, group)

    def is_agent_dying(self, local_metric: float, threshold_metric: float, check_policy: int = 0) -> bool:
        """Whether ``local_metric`` is below ``threshold_metric`` (non-finite: dying)."""
        return not float(local_metric) >= float(threshold_metric) or not math.isfinite(float(local_metric))


class AsyncSelectiveAveragingPolicympi4pyGeneral(_OneSided):
    """As :class:`AsyncSelectiveAveragingPolicympi4pyFast` (popmesh uses one window for both);
    ``poll_interval_s`` is accepted and, as in torchgfn, unused."""

    def __init__(self, model_builder: Any, model: Any, average_every: int, threshold_metric: float = 0.0,
                 replacement_ratio: float = 0.2, averaging_strategy: str = "mean", momentum: float = 0.0,
                 poll_interval_s: float = 0.01, age_range: tuple[int, int] = (50, 150),
                 replacement_mode: str = "age", group: Any = _COMM_WORLD) -> None:
        super().__init__(average_every)
        self.poll_interval_s = poll_interval_s
        self._setup(model_builder, threshold_metric, replacement_ratio, averaging_strategy, momentum, age_range,
                    replacement_mode, group)

    def is_agent_dying(self, local_metric: float, threshold_metric: float, check_agent: int = 0) -> bool:
        """Whether ``local_metric`` is below ``threshold_metric`` (non-finite: dying)."""
        return not float(local_metric) >= float(threshold_metric) or not math.isfinite(float(local_metric))
