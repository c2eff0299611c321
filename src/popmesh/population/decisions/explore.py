"""Ray-PBT-style exploration: perturb or resample the hyper-parameters of a replaced agent.

Follows Ray Tune's ``PopulationBasedTraining`` explore step (its ``hyperparam_mutations``): with
probability ``resample_prob`` a hyper-parameter that has a search space is drawn afresh from it;
otherwise a number is multiplied by one of the ``perturb`` factors and a categorical value moves to a
neighbouring choice.

A search space entry is a list of choices, a sampler ``f(rng)``, or a typed declaration:
:class:`Continuous` (linear or log scale), :class:`Integer` and :class:`Categorical`. A declaration
has bounds (or a list) that every explored value stays within, and checks the current value against
them; :func:`sample_hparams` draws starting values from declarations.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.selection import RngLike, as_generator

__all__ = ["explore", "SpaceEntry", "Declaration", "Continuous", "Integer", "Categorical", "sample_hparams",
           "check_space"]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Declaration(ABC):
    """A declared hyper-parameter: what values it may take and how the explore step moves it.

    Bounds are inclusive and hold for every value explore gives. Ray Tune clips a perturbed value to
    its ``tune.uniform``/``loguniform``/``randint`` domain but never checks the starting value, and a
    plain function space has no bounds at all; popmesh clips the same way, and raises a ConfigError
    when the current value already lies outside the declaration.
    """

    @abstractmethod
    def check(self, name: str, value: Any) -> None:
        """ConfigError naming ``name`` when ``value`` is not one this declaration allows."""

    @abstractmethod
    def sample(self, gen: np.random.Generator) -> Any:
        """A value drawn afresh from the declaration (the resample step)."""

    @abstractmethod
    def move(self, value: Any, gen: np.random.Generator, perturb: Sequence[float]) -> Any:
        """The perturbation step from ``value``: by a factor of ``perturb``, or to a neighbour."""

    def explore(self, value: Any, gen: np.random.Generator, perturb: Sequence[float], resample_prob: float) -> Any:
        """Resample with probability ``resample_prob``, else :meth:`move` (one uniform draw decides)."""
        if gen.random() < resample_prob:
            return self.sample(gen)
        return self.move(value, gen, perturb)


def _check_bounds(kind: str, low: Any, high: Any, log: bool, is_value: Callable[[Any], bool]) -> None:
    if not (is_value(low) and is_value(high) and math.isfinite(low) and math.isfinite(high)) or not low < high:
        raise ConfigError(f"{kind}(low, high) needs finite bounds with low < high, got ({low!r}, {high!r})")
    if log and low <= 0:
        raise ConfigError(f"{kind}(log=True) needs a positive low bound (log scale), got {low!r}; "
                          "use log=False for a range that reaches 0 or below")


_ROUNDING = 1e-6
"""A continuous value this close to a bound (relative) counts as at it: a value kept in a float32
buffer or tensor comes back a few 1e-8 away from the float64 bound it was clipped to."""


def _outside(name: str, value: Any, low: Any, high: Any) -> ConfigError:
    return ConfigError(f"hyper-parameter {name!r} = {value!r} lies outside its declared bounds [{low!r}, {high!r}]: "
                       "start it inside them or widen the declaration")


@dataclass(frozen=True)
class Continuous(Declaration):
    """A real hyper-parameter in ``[low, high]``: perturbed by a factor (the product clipped to the
    bounds, as Ray Tune does), or resampled uniformly, log-uniformly with ``log=True`` (Ray's
    ``tune.uniform`` and ``tune.loguniform``; a log bound must be positive)."""

    low: float
    high: float
    log: bool = False

    def __post_init__(self) -> None:
        _check_bounds("Continuous", self.low, self.high, self.log, _is_number)

    def check(self, name: str, value: Any) -> None:
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(f"hyper-parameter {name!r} is declared Continuous but is {value!r}: give a finite number")
        if not self.low - _ROUNDING * abs(self.low) <= value <= self.high + _ROUNDING * abs(self.high):
            raise _outside(name, value, self.low, self.high)

    def sample(self, gen: np.random.Generator) -> float:
        if self.log:
            drawn = math.exp(gen.uniform(math.log(self.low), math.log(self.high)))
        else:
            drawn = gen.uniform(self.low, self.high)
        return min(max(float(drawn), float(self.low)), float(self.high))

    def move(self, value: Any, gen: np.random.Generator, perturb: Sequence[float]) -> float:
        factor = perturb[int(gen.integers(len(perturb)))]
        return min(max(float(value) * factor, float(self.low)), float(self.high))


@dataclass(frozen=True)
class Integer(Declaration):
    """An integer hyper-parameter in ``[low, high]``, both included: perturbed by a factor and rounded,
    moving by at least 1 (Ray truncates ``int(value * factor)``, so a small integer may never move),
    then clipped; or resampled uniformly, log-uniformly with ``log=True`` (a batch size; ``low >= 1``).
    Ray's ``tune.randint`` excludes its upper bound; here ``high`` is a value it may take."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self) -> None:
        _check_bounds("Integer", self.low, self.high, self.log, _is_int)

    def check(self, name: str, value: Any) -> None:
        if not _is_int(value):
            raise ConfigError(f"hyper-parameter {name!r} is declared Integer but is {value!r}: give an int")
        if not self.low <= value <= self.high:
            raise _outside(name, value, self.low, self.high)

    def sample(self, gen: np.random.Generator) -> int:
        if self.log:
            drawn = math.floor(math.exp(gen.uniform(math.log(self.low), math.log(self.high + 1))))
            return min(max(int(drawn), int(self.low)), int(self.high))
        return int(gen.integers(self.low, self.high + 1))

    def move(self, value: Any, gen: np.random.Generator, perturb: Sequence[float]) -> int:
        factor = perturb[int(gen.integers(len(perturb)))]
        return min(max(int(_scale(int(value), factor)), int(self.low)), int(self.high))


@dataclass(frozen=True)
class Categorical(Declaration):
    """One of ``choices`` (a list in Ray's ``hyperparam_mutations``): the perturbation step moves to a
    neighbouring choice, up or down with equal odds; at either end it moves to the only neighbour
    (Ray clips there and keeps the value half the time). Resampling draws any choice uniformly. The
    choices must be distinct; a value outside them is a ConfigError (Ray resamples it silently)."""

    choices: Sequence[Any]

    def __post_init__(self) -> None:
        if isinstance(self.choices, (str, bytes)) or not isinstance(self.choices, Sequence) or not self.choices:
            raise ConfigError(f"Categorical needs a non-empty list of choices, got {self.choices!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if any(self.choices.index(c) != i for i, c in enumerate(self.choices)):
            raise ConfigError(f"Categorical choices must be distinct, got {list(self.choices)}")

    def check(self, name: str, value: Any) -> None:
        if value not in self.choices:
            raise ConfigError(f"hyper-parameter {name!r} = {value!r} is not one of its choices {list(self.choices)}: "
                              "start it at one of them or add it to the list")

    def sample(self, gen: np.random.Generator) -> Any:
        return self.choices[int(gen.integers(len(self.choices)))]

    def move(self, value: Any, gen: np.random.Generator, perturb: Sequence[float]) -> Any:
        up = gen.random() < 0.5
        last = len(self.choices) - 1
        i = self.choices.index(value)
        if last == 0:
            return value
        j = i + 1 if (up and i < last) or i == 0 else i - 1
        return self.choices[j]


SpaceEntry = Sequence[Any] | Callable[[np.random.Generator], Any] | Declaration
"""A list/tuple of discrete choices, a sampler ``f(rng) -> value`` for a continuous space, or a
typed :class:`Declaration` (:class:`Continuous`, :class:`Integer`, :class:`Categorical`)."""


def check_space(space: Mapping[str, SpaceEntry], perturb: Sequence[float] = (0.8, 1.2),
                resample_prob: float = 0.25) -> None:
    """ConfigError for settings no explore step can use: factors that are not positive, a probability
    outside [0, 1], a space entry that is neither a non-empty list, a sampler nor a declaration."""
    if not perturb or not all(_is_number(f) and math.isfinite(f) and f > 0 for f in perturb):
        raise ConfigError(f"perturb must be a non-empty sequence of positive factors, got {perturb!r}")
    if not _is_number(resample_prob) or not 0.0 <= resample_prob <= 1.0:
        raise ConfigError(f"resample_prob must be in [0, 1], got {resample_prob!r}")
    for key, entry in space.items():
        if isinstance(entry, Declaration) or callable(entry):
            continue
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) == 0:
            raise ConfigError(f"space[{key!r}] must be a non-empty list of choices, a sampler f(rng) or a "
                              "declaration (Continuous, Integer, Categorical)")


def _check(perturb: Sequence[float], resample_prob: float, hparams: Mapping[str, Any],
           space: Mapping[str, SpaceEntry]) -> None:
    check_space(space, perturb, resample_prob)
    unknown = sorted(set(space) - set(hparams))
    if unknown:
        raise ConfigError(f"space names hyper-parameters {unknown} that hparams lacks; "
                          f"known: {sorted(hparams)}")
    for key, entry in space.items():
        if isinstance(entry, Declaration):
            entry.check(key, hparams[key])


def _scale(value: Any, factor: float) -> Any:
    """``value · factor``; an int stays an int and moves by at least 1 when the product would round back."""
    if isinstance(value, numbers.Integral):
        new = round(int(value) * factor)
        if new == value and value * factor != value:
            new += 1 if value * factor > value else -1
        return new
    return float(value) * factor


def _explore_one(value: Any, entry: SpaceEntry | None, gen: np.random.Generator,
                 perturb: Sequence[float], resample_prob: float) -> Any:
    if isinstance(entry, Declaration):
        return entry.explore(value, gen, perturb, resample_prob)
    if entry is None:
        return _scale(value, perturb[int(gen.integers(len(perturb)))]) if _is_number(value) else value
    resample = gen.random() < resample_prob
    if callable(entry):
        if resample or not _is_number(value):
            return entry(gen)
        return _scale(value, perturb[int(gen.integers(len(perturb)))])
    choices = list(entry)
    if resample or value not in choices:
        return choices[int(gen.integers(len(choices)))]
    i = choices.index(value) + (1 if gen.random() < 0.5 else -1)
    return choices[min(max(i, 0), len(choices) - 1)]


def explore(hparams: Mapping[str, Any], rng: RngLike, perturb: Sequence[float] = (0.8, 1.2),
            resample_prob: float = 0.25, space: Mapping[str, SpaceEntry] | None = None) -> dict[str, Any]:
    """New hyper-parameters for a replaced agent; ``hparams`` itself is not changed.

    For each key, in order: with a ``space`` entry that is a list of choices, resample uniformly with
    probability ``resample_prob`` (or when the current value is not a choice), else move one step up
    or down the list (clipped at the ends); with a sampler, resample with ``resample_prob`` else
    multiply by a factor drawn from ``perturb``; with a :class:`Declaration`, its own
    :meth:`~Declaration.explore` (within its bounds; the current value must satisfy it). A number
    without a space entry is always multiplied; anything else without one (strings, bools) is kept.
    Ints stay ints and change by at least 1. Deterministic for the same inputs and seed. A space key
    that ``hparams`` lacks is a ConfigError.
    """
    space = {} if space is None else dict(space)
    _check(perturb, resample_prob, hparams, space)
    gen = as_generator(rng, "explore")
    return {key: _explore_one(value, space.get(key), gen, perturb, resample_prob)
            for key, value in hparams.items()}


def sample_hparams(space: Mapping[str, Declaration], rng: RngLike) -> dict[str, Any]:
    """Starting values drawn from declarations, in the order of ``space`` (as Ray Tune fills a trial's
    config from ``hyperparam_mutations``): a wide initial range for each agent of a population."""
    bad = sorted(k for k, v in space.items() if not isinstance(v, Declaration))
    if bad:
        raise ConfigError(f"sample_hparams draws from declarations only; {bad} are not Continuous, Integer "
                          "or Categorical")
    gen = as_generator(rng, "sample_hparams")
    return {key: entry.sample(gen) for key, entry in space.items()}
