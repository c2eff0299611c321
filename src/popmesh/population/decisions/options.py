"""The settings every selective policy shares, checked once at construction.

:class:`SelectiveOptions` gathers the decision rules (pure core), the combination settings and the
optimizer-state policy; :class:`Explore` configures Ray-PBT-style perturbation of the optimizer's
hyper-parameters on replaced ranks. Nothing here communicates.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import DEFAULT_OPTIMIZER_POLICY, OptimizerPolicy, Strategy, _check_momentum
from popmesh.population.decisions.decision import Decision, decide
from popmesh.population.decisions.explore import SpaceEntry, check_space, explore
from popmesh.population.decisions.selection import DonorRule, ReplacementRule, SelectionState, _is_real, init_state

__all__ = ["Explore", "SelectiveOptions", "check_every", "check_metric", "due"]


def check_every(every: int) -> int:
    """``every`` as a positive int (the cadence in iterations)."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ConfigError(f"every must be a positive number of iterations, got {every!r}")
    return int(every)


def due(iteration: int, every: int) -> bool:
    """Whether ``iteration`` is a decision point: a multiple of ``every`` (iteration 0 included)."""
    if isinstance(iteration, bool) or not isinstance(iteration, (int, np.integer)) or iteration < 0:
        raise ConfigError(f"iteration must be a non-negative int, got {iteration!r}")
    return int(iteration) % every == 0


def check_metric(metric: Any, iteration: int) -> float:
    """The local metric as a float; NaN/inf are legal (they never donate), None is not."""
    if metric is None:
        raise ConfigError(f"iteration {iteration} is a decision point: pass local_metric (higher is better; "
                          "NaN marks an agent that must not donate)")
    try:
        return float(metric)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"local_metric must be a number, got {type(metric).__name__}") from e


@dataclass(frozen=True)
class Explore:
    """Perturb a replaced agent's optimizer hyper-parameters after replacement (Ray PBT's explore).

    ``keys`` name entries of the ``optimizer.param_groups`` dicts (default the learning rate):
    ``param_groups`` picks the groups by index (a value is read from the first of them and written to
    each), None every group (then each must have the keys). A model whose groups train at their own
    rates (torchgfn's ``logZ`` at 0.1 beside the policy's) explores one of them with
    ``param_groups=(0,)`` and leaves the others alone. Each key is passed through
    :func:`popmesh.population.explore` with ``space``, ``perturb`` and ``resample_prob``, seeded by
    (policy seed, iteration, global rank): deterministic and different per agent. ``space`` may declare
    a key (``{"lr": Continuous(1e-5, 1e-1, log=True)}``); it names no key outside ``keys``.

    With :class:`AsyncSelectiveAveraging`'s ``decide="latest"`` a key may also be any value the training
    loop reads (passed to the call as ``hparams=``), the replaced agent starts from its donor's values
    (PBT's exploit), and ``pb2=PB2()`` chooses the declared continuous and integer ones with PB2's model
    of the population's progress instead of the perturbation
    (:mod:`~popmesh.population.decisions.hparams`).
    """

    keys: tuple[str, ...] = ("lr",)
    space: Mapping[str, SpaceEntry] = field(default_factory=dict)
    perturb: tuple[float, ...] = (0.8, 1.2)
    resample_prob: float = 0.25
    pb2: Any = None
    param_groups: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.keys or not all(isinstance(k, str) for k in self.keys):
            raise ConfigError(f"Explore keys must be a non-empty tuple of param-group names, got {self.keys!r}")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "perturb", tuple(self.perturb))
        unknown = sorted(set(self.space) - set(self.keys))
        if unknown:
            raise ConfigError(f"Explore space names {unknown}, which are not among keys {list(self.keys)}: "
                              "add them to keys= or take them out of space=")
        check_space(self.space, self.perturb, self.resample_prob)
        if self.param_groups is not None:
            groups = tuple(self.param_groups)
            if not groups or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in groups) \
                    or len(set(groups)) != len(groups):
                raise ConfigError(f"Explore param_groups must be distinct indexes of optimizer.param_groups, like "
                                  f"(0,), or None for every group; got {self.param_groups!r}")
            object.__setattr__(self, "param_groups", groups)
        if self.pb2 is not None:
            from popmesh.population.decisions.pb2 import PB2

            if not isinstance(self.pb2, PB2):
                raise ConfigError(f"Explore(pb2=...) takes a PB2(...) of its options, got {type(self.pb2).__name__}")

    def groups(self, optimizer: Any) -> list[dict[str, Any]]:
        """The param groups of ``optimizer`` that the keys are read from (the first) and written to."""
        every = list(getattr(optimizer, "param_groups", ()))
        if self.param_groups is None:
            return every
        outside = [i for i in self.param_groups if i >= len(every)]
        if outside:
            raise ConfigError(f"Explore param_groups {list(outside)} are not among the optimizer's {len(every)} "
                              f"param group(s): give indexes below {len(every)}")
        return [every[i] for i in self.param_groups]

    def apply(self, optimizer: Any, seed: int, iteration: int, rank: int) -> dict[str, list[Any]]:
        """Perturb ``optimizer``'s chosen param groups in place; return ``{key: [old, new]}`` (the first)."""
        changed: dict[str, list[Any]] = {}
        rng = np.random.default_rng([seed, iteration, rank])
        for group in self.groups(optimizer):
            missing = [k for k in self.keys if k not in group]
            if missing:
                raise ConfigError(f"Explore keys {missing} are not optimizer hyper-parameters; "
                                  f"param groups have {sorted(k for k in group if k != 'params')}")
            old = {k: group[k] for k in self.keys}
            new = explore(old, rng, self.perturb, self.resample_prob, self.space)
            group.update(new)
            for k in self.keys:
                changed.setdefault(k, [old[k], new[k]])
        return changed


def _callable_or_none(value: Any, name: str, signature: str) -> Callable[..., Any] | None:
    if value is not None and not callable(value):
        raise ConfigError(f"{name} must be a callable {signature}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class SelectiveOptions:
    """Everything a selective policy decides and combines with (see the policies' docstrings)."""

    every: int
    rule: ReplacementRule = field(default_factory=lambda: ReplacementRule(ratio=0.25))
    donor_rule: DonorRule = field(default_factory=DonorRule)
    strategy: Strategy = Strategy.MEAN
    momentum: float = 0.0
    optimizer_policy: OptimizerPolicy = DEFAULT_OPTIMIZER_POLICY
    optimizer_builder: Callable[[Any], Any] | None = None
    model_builder: Callable[[], Any] | None = None
    include_buffers: bool = False
    explore: Explore | None = None
    seed: int = 0
    events_path: str | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "every", check_every(self.every))
        put(self, "strategy", Strategy.parse(self.strategy))
        put(self, "optimizer_policy", OptimizerPolicy.parse(self.optimizer_policy))
        put(self, "donor_rule", DonorRule() if self.donor_rule is None else self.donor_rule)
        put(self, "momentum", _check_momentum(self.momentum))
        self._check_types()
        if self.strategy is Strategy.RESET and self.model_builder is None:
            raise ConfigError("strategy='reset_weights' re-initialises replaced agents: pass "
                              "model_builder=<callable returning a fresh model of the same architecture>")
        if self.timeout is not None and (not _is_real(self.timeout) or not self.timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.events_path is not None:
            put(self, "events_path", os.fspath(self.events_path))

    def _check_types(self) -> None:
        if not isinstance(self.rule, ReplacementRule):
            raise ConfigError(f"rule must be a ReplacementRule, got {type(self.rule).__name__}")
        if not isinstance(self.donor_rule, DonorRule):
            raise ConfigError(f"donor_rule must be a DonorRule, got {type(self.donor_rule).__name__}")
        if self.explore is not None and not isinstance(self.explore, Explore):
            raise ConfigError(f"explore must be an Explore(...), got {type(self.explore).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative int, got {self.seed!r}")
        _callable_or_none(self.optimizer_builder, "optimizer_builder", "f(model) -> optimizer")
        _callable_or_none(self.model_builder, "model_builder", "f() -> model")

    @classmethod
    def build(cls, every: int, options: Mapping[str, Any], who: str) -> SelectiveOptions:
        """``SelectiveOptions(every, **options)``, with a ConfigError naming the valid options for
        an unknown keyword (``who`` is the policy's name)."""
        valid = [f.name for f in fields(cls) if f.name != "every"]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"{who} got unknown options {unknown}; valid: {valid}")
        return cls(every, **options)

    def init_state(self, n: int) -> SelectionState:
        """Fresh selection state for a population of ``n`` (ages drawn from the seed)."""
        return init_state(n, self.rule, self.seed)

    def decide(self, metrics: Sequence[float], iteration: int, state: SelectionState) -> Decision:
        """The pure decision for ``metrics`` (index = group rank): same inputs and seed, same result."""
        return decide([float(m) for m in metrics], self.rule, self.donor_rule, self.strategy,
                      iteration=iteration, state=state, rng=np.random.default_rng([self.seed, iteration]),
                      optimizer_policy=self.optimizer_policy)

