"""Ray-PBT-style exploration: perturb or resample the hyper-parameters of a replaced agent.

Follows Ray Tune's ``PopulationBasedTraining`` explore step: with probability ``resample_prob`` a
hyper-parameter that has a search space is drawn afresh from it; otherwise a number is multiplied
by one of the ``perturb`` factors and a categorical value moves to a neighbouring choice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.selection import RngLike, as_generator

__all__ = ["explore", "SpaceEntry"]

SpaceEntry = Sequence[Any] | Callable[[np.random.Generator], Any]
"""A list/tuple of discrete choices, or a sampler ``f(rng) -> value`` for a continuous space."""


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check(perturb: Sequence[float], resample_prob: float, hparams: Mapping[str, Any],
           space: Mapping[str, SpaceEntry]) -> None:
    if not perturb or not all(_is_number(f) and math.isfinite(f) and f > 0 for f in perturb):
        raise ConfigError(f"perturb must be a non-empty sequence of positive factors, got {perturb!r}")
    if not _is_number(resample_prob) or not 0.0 <= resample_prob <= 1.0:
        raise ConfigError(f"resample_prob must be in [0, 1], got {resample_prob!r}")
    unknown = sorted(set(space) - set(hparams))
    if unknown:
        raise ConfigError(f"space names hyper-parameters {unknown} that hparams lacks; "
                          f"known: {sorted(hparams)}")
    for key, entry in space.items():
        if not callable(entry) and (isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence)
                                    or len(entry) == 0):
            raise ConfigError(f"space[{key!r}] must be a non-empty list of choices or a sampler f(rng)")


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
    multiply by a factor drawn from ``perturb``. A number without a space entry is always multiplied;
    anything else without one (strings, bools) is kept. Ints stay ints and change by at least 1.
    Deterministic for the same inputs and seed.
    """
    space = {} if space is None else dict(space)
    _check(perturb, resample_prob, hparams, space)
    gen = as_generator(rng, "explore")
    return {key: _explore_one(value, space.get(key), gen, perturb, resample_prob)
            for key, value in hparams.items()}
