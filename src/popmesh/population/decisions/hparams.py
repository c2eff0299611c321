"""Explored hyper-parameters as they travel: read and checked, carried in a report, and assigned to a
replaced agent.

PBT's exploit hands a replaced agent its donor's hyper-parameters with its weights, and the explore
step then moves them (Ray Tune: the donor's config, perturbed or resampled). With
``decide="latest"`` every report carries the values of :class:`~popmesh.population.Explore`'s keys, so
the coordinator can do both for the replaced rank (:func:`assign`) and send it the values to train
at. A key is read from the optimizer's param groups when they have it (the learning rate, Adam's
betas as a whole, weight decay), else from what the training loop passed (``hparams=``: an entropy
coefficient, a clip ratio, a batch size). Pure: no process, no communication.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.explore import Categorical, Declaration, explore
from popmesh.population.decisions.options import Explore

__all__ = ["current_values", "encode", "decode", "assign"]

_FLOAT, _INT, _BOOL, _CHOICE = 0.0, 1.0, 2.0, 3.0


def current_values(explore: Explore, optimizer: Any, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The value of every key of ``explore``: the entry of the first param group it explores
    (:meth:`Explore.groups`), else ``given``'s.

    ConfigError naming a key found in neither (with where to put it), a ``given`` name that is not a
    key, and a value outside its declaration."""
    given = {} if given is None else dict(given)
    unknown = sorted(set(given) - set(explore.keys))
    if unknown:
        raise ConfigError(f"hparams= names {unknown}, which Explore(keys=...) does not declare ({list(explore.keys)}): "
                          "add them to keys= (with a space= entry for their bounds) or leave them out")
    chosen = explore.groups(optimizer) if optimizer is not None else []
    group = chosen[0] if chosen else {}
    values: dict[str, Any] = {}
    for key in explore.keys:
        if key in group:
            values[key] = group[key]
        elif key in given:
            values[key] = given[key]
        else:
            where = sorted(k for k in group if k != "params")
            raise ConfigError(f"explored hyper-parameter {key!r} is neither an optimizer param-group field ({where}) "
                              f"nor passed in hparams=: pass hparams={{{key!r}: <its current value>}} to the policy "
                              "call, or take it out of Explore(keys=...)")
        entry = explore.space.get(key)
        if isinstance(entry, Declaration):
            entry.check(key, values[key])
    return values


def _choices(entry: Any) -> Sequence[Any] | None:
    if isinstance(entry, Categorical):
        return entry.choices
    if isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)):
        return entry
    return None


def encode(explore: Explore, values: Mapping[str, Any]) -> np.ndarray:
    """Two floats per key, in ``explore.keys``' order: a kind (float, int, bool, index into a list of
    choices) and the value. ConfigError for a value that is none of them."""
    out = np.empty(2 * len(explore.keys), dtype=np.float64)
    for i, key in enumerate(explore.keys):
        value, choices = values[key], _choices(explore.space.get(key))
        if choices is not None and value in choices:
            out[2 * i:2 * i + 2] = (_CHOICE, list(choices).index(value))
        elif isinstance(value, bool):
            out[2 * i:2 * i + 2] = (_BOOL, float(value))
        elif isinstance(value, numbers.Integral) and abs(int(value)) < 2 ** 53:
            out[2 * i:2 * i + 2] = (_INT, float(value))
        elif isinstance(value, numbers.Real):
            out[2 * i:2 * i + 2] = (_FLOAT, float(value))
        else:
            raise ConfigError(f"explored hyper-parameter {key!r} = {value!r} is not a number: declare its values "
                              f"with space={{{key!r}: Categorical([...])}} so that it can travel in a report")
    return out


def decode(explore: Explore, row: Sequence[float]) -> dict[str, Any]:
    """The values that :func:`encode` wrote (empty for an empty row)."""
    if len(row) == 0:
        return {}
    if len(row) != 2 * len(explore.keys):
        raise ConfigError(f"a report carried {len(row) // 2} hyper-parameters, this policy explores "
                          f"{len(explore.keys)} ({list(explore.keys)}): every rank must explore the same keys")
    values: dict[str, Any] = {}
    for i, key in enumerate(explore.keys):
        kind, value = row[2 * i], row[2 * i + 1]
        if kind == _CHOICE:
            choices = _choices(explore.space.get(key))
            values[key] = list(choices)[int(value)] if choices is not None else value
        else:
            values[key] = bool(value) if kind == _BOOL else int(value) if kind == _INT else float(value)
    return values


def assign(inherited: Mapping[str, Any], explore: Explore | None, seed: int, iteration: int, rank: int,
           observations: Sequence[Any] = (), clock: float = 0.0,
           pending: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """What replaced group rank ``rank`` trains at: the donor's values ``inherited``, moved by the
    explore step (Ray's perturb-or-resample, or PB2's model of ``observations`` when ``explore.pb2`` is
    set, given the values of the members training now, ``pending``), seeded by (seed, iteration,
    rank): the same inputs give the same values."""
    if explore is None or not inherited:
        return dict(inherited)
    rng = np.random.default_rng([seed, iteration, rank])
    if explore.pb2 is None:
        return _explore_values(inherited, explore, rng)
    from popmesh.population.decisions.pb2 import pb2_explore

    return pb2_explore(inherited, explore.space, observations, clock, rng, pending=pending, options=explore.pb2,
                       perturb=explore.perturb, resample_prob=explore.resample_prob)


def _explore_values(inherited: Mapping[str, Any], spec: Explore, rng: np.random.Generator) -> dict[str, Any]:
    """Ray PBT's explore step over ``inherited``, a float that came back whole staying a float."""
    moved = explore(dict(inherited), rng, spec.perturb, spec.resample_prob, spec.space)
    return {k: _float_as(inherited[k], v) for k, v in moved.items()}


def _float_as(before: Any, value: Any) -> Any:
    """``value`` as a float when ``before`` was one (an int-valued factor product stays a float)."""
    if isinstance(before, float) and not isinstance(value, bool) and isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else value
    return value
