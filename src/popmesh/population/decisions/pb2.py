"""PB2's explore step: a replaced agent's hyper-parameters chosen by a Gaussian-process bandit.

Population Based Bandits (Parker-Holder et al. 2020, "Provably Efficient Online Hyperparameter
Optimization with Population-Based Bandits"; Ray Tune's ``PB2`` scheduler) keeps PBT's exploit step
and replaces its random explore step with a model: a Gaussian process fitted to every member's
recent progress (the objective's change over an interval, given the clock and the hyper-parameters
it trained with) picks the hyper-parameters with the highest upper confidence bound of the change
over the next interval. Hyper-parameters other members are training with right now count as
observed at the model's own prediction (GP-BUCB's hallucination, by default without noise: the
kriging believer), so that a batch of suggestions spreads out.

The model is scikit-learn's ``GaussianProcessRegressor`` (``pip install 'popmesh[pb2]'``), imported
only when :func:`pb2_explore` runs.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.explore import (
    Continuous,
    Declaration,
    Integer,
    SpaceEntry,
    _is_int,
    _is_number,
    check_space,
    explore,
)
from popmesh.population.decisions.selection import RngLike, as_generator

__all__ = ["Observation", "PB2", "pb2_explore"]

Bounded = Continuous | Integer
_INSTALL = "PB2 needs scikit-learn: pip install 'popmesh[pb2]'"
_CLIP = 2.0  # standardised changes are clipped to ±2, as PB2 does, so one outlier cannot dominate the fit
_JITTER = 1e-6  # added to a hallucinated point's noise: two equal pending points stay solvable
_REFINE_SD = 0.05  # spread of the local candidates around the best random one, in unit coordinates


class Observation(NamedTuple):
    """One member's progress over one interval: experience at its start and end, the hyper-parameters
    it trained with, and the objective's change over it."""

    start: float  # clock (env steps or iterations) at the interval's start
    end: float  # clock at its end (> start)
    hparams: Mapping[str, Any]
    change: float  # objective at end minus objective at start (finite)


def _least_int(value: Any, name: str, least: int, hint: str) -> None:
    if not _is_int(value) or value < least:
        raise ConfigError(f"PB2 {name} must be an int >= {least}, got {value!r}: {hint}")


def _least_real(value: Any, name: str, least: float, hint: str, *, strict: bool = False, none: bool = False) -> None:
    if none and value is None:
        return
    if not _is_number(value) or not math.isfinite(value) or value < least or (strict and value == least):
        bound = f"> {least}" if strict else f">= {least}"
        raise ConfigError(f"PB2 {name} must be a finite number {bound}, got {value!r}: {hint}")


@dataclass(frozen=True)
class PB2:
    """Options of the model-based explore step.

    ``window``: the most recent observations (by end clock) the GP is fitted to. Ray's PB2 keeps its
    last 1000 points and fits at least the last 200 of them (``select_length``'s ``min_len``); 200
    keeps a fit well under half a second on one core. ``candidates``: uniform random points the acquisition
    scores, then a quarter as many around the best of them (Ray runs 10 L-BFGS-B starts instead).
    ``kappa``: the UCB weight on the posterior standard deviation; ``None`` follows GP-UCB's growing
    schedule as Ray's PB2 sets it, ``sqrt(beta_offset + max(0, log(beta_growth · n)))`` for ``n``
    fitted observations (Ray's ``c1 = 0.2`` and ``c2 = 0.4``). Ray weighs the posterior variance
    rather than the standard deviation; popmesh follows GP-UCB. ``pending_noise``: the noise of a
    hallucinated pending observation, as a fraction of the fitted noise. 1.0 is GP-BUCB's
    hallucination (Ray refits a second GP with the pending points at the average change); with dense
    data it barely moves the bound, so a batch repeats itself. The default 0 believes the prediction
    outright (Ginsbourger et al.'s "kriging believer"), which spreads a batch even then.
    ``restarts``: extra random starts of the GP's hyper-parameter optimizer (scikit-learn's
    ``n_restarts_optimizer``, default 0 as there; each costs about one more fit).
    """

    window: int = 200
    candidates: int = 1000
    kappa: float | None = None
    beta_offset: float = 0.2
    beta_growth: float = 0.4
    pending_noise: float = 0.0
    restarts: int = 0

    def __post_init__(self) -> None:
        _least_int(self.window, "window", 2, "the GP needs at least two observations to fit")
        _least_int(self.candidates, "candidates", 1, "give the number of random points to score")
        _least_int(self.restarts, "restarts", 0, "use 0 for one optimizer run")
        _least_real(self.kappa, "kappa", 0.0, "or None for GP-UCB's schedule", none=True)
        _least_real(self.beta_offset, "beta_offset", 0.0, "Ray's PB2 uses 0.2")
        _least_real(self.beta_growth, "beta_growth", 0.0, "Ray's PB2 uses 0.4", strict=True)
        _least_real(self.pending_noise, "pending_noise", 0.0, "0 believes the prediction, 1 is GP-BUCB's")

    def ucb_weight(self, n: int) -> float:
        """The UCB weight for a fit on ``n`` observations."""
        if self.kappa is not None:
            return float(self.kappa)
        return math.sqrt(self.beta_offset + max(0.0, math.log(self.beta_growth * n)))


def _sklearn() -> tuple[Any, Any]:
    """scikit-learn's ``gaussian_process`` and its ``kernels`` module, or the install hint."""
    try:
        return (importlib.import_module("sklearn.gaussian_process"),
                importlib.import_module("sklearn.gaussian_process.kernels"))
    except ImportError as e:
        raise ConfigError(_INSTALL) from e


def _to_unit(value: float, entry: Bounded) -> float:
    """``value`` mapped to [0, 1] by its bounds (on a log scale for a log declaration)."""
    if entry.log:
        return (math.log(value) - math.log(entry.low)) / (math.log(entry.high) - math.log(entry.low))
    return (value - entry.low) / (entry.high - entry.low)


def _from_unit(u: float, entry: Bounded) -> float | int:
    """The inverse of :func:`_to_unit`, clipped to the bounds; an Integer rounds to an int."""
    u = min(max(float(u), 0.0), 1.0)
    if entry.log:
        value = math.exp(math.log(entry.low) + u * (math.log(entry.high) - math.log(entry.low)))
    else:
        value = entry.low + u * (entry.high - entry.low)
    if isinstance(entry, Integer):
        return min(max(round(value), int(entry.low)), int(entry.high))
    return min(max(value, float(entry.low)), float(entry.high))


def _check_point(values: Mapping[str, Any], modelled: Mapping[str, Bounded], where: str) -> list[float]:
    """The modelled values of ``values`` in unit coordinates; ConfigError naming ``where``."""
    out = []
    for key, entry in modelled.items():
        if key not in values:
            raise ConfigError(f"{where} lacks the modelled hyper-parameter {key!r}: record every "
                              f"Continuous/Integer key of the space ({sorted(modelled)})")
        value = values[key]
        try:  # the declaration's own check: a value a float32 round trip moved past a bound still counts
            entry.check(key, value)
        except ConfigError as e:
            raise ConfigError(f"{where}[{key!r}] = {value!r} is not a number within its declared bounds "
                              f"[{entry.low!r}, {entry.high!r}]: record the value it trained with, or widen "
                              "the declaration") from e
        out.append(min(max(_to_unit(float(value), entry), 0.0), 1.0))
    return out


def _check_observation(i: int, obs: Any, modelled: Mapping[str, Bounded]) -> tuple[float, float, list[float]]:
    """``(end, change per unit of clock, unit hyper-parameters)`` of observation ``i``."""
    if not isinstance(obs, Observation):
        raise ConfigError(f"observations[{i}] must be an Observation(start, end, hparams, change), "
                          f"got {type(obs).__name__}")
    if not (_is_number(obs.start) and _is_number(obs.end) and math.isfinite(obs.start)
            and math.isfinite(obs.end)) or not obs.end > obs.start:
        raise ConfigError(f"observations[{i}] runs from {obs.start!r} to {obs.end!r}: an interval needs finite "
                          "clocks with end > start (leave out intervals in which the clock did not move)")
    if not _is_number(obs.change) or not math.isfinite(obs.change):
        raise ConfigError(f"observations[{i}] has change = {obs.change!r}: give a finite objective change, or "
                          "leave out the interval of a member whose objective was not finite")
    units = _check_point(obs.hparams, modelled, f"observations[{i}].hparams")
    return float(obs.end), float(obs.change) / (float(obs.end) - float(obs.start)), units


def _check_inputs(hparams: Mapping[str, Any], space: Mapping[str, SpaceEntry], clock: float,
                  perturb: Sequence[float], resample_prob: float, options: Any) -> None:
    check_space(space, perturb, resample_prob)
    missing = sorted(set(space) - set(hparams))
    if missing:
        raise ConfigError(f"space names hyper-parameters {missing} that hparams lacks; known: {sorted(hparams)}")
    for key, entry in space.items():
        if isinstance(entry, Declaration):
            entry.check(key, hparams[key])
    if not _is_number(clock) or not math.isfinite(clock):
        raise ConfigError(f"clock must be a finite number (the donor's experience), got {clock!r}")
    if not isinstance(options, PB2):
        raise ConfigError(f"options must be a PB2(...) or None, got {type(options).__name__}")


def _dataset(observations: Sequence[Any], modelled: Mapping[str, Bounded],
             window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Ends, rates and unit hyper-parameters of the latest ``window`` observations, and whether the
    data can inform a model (two or more observations whose changes and rates are not all equal)."""
    rows = [_check_observation(i, obs, modelled) for i, obs in enumerate(observations)]
    changes = [float(obs.change) for obs in observations]
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])[-window:]
    ends = np.array([rows[i][0] for i in order], dtype=np.float64)
    rates = np.array([rows[i][1] for i in order], dtype=np.float64)
    units = np.array([rows[i][2] for i in order], dtype=np.float64).reshape(len(order), len(modelled))
    usable = len(order) >= 2 and np.ptp(rates) > 0 and np.ptp([changes[i] for i in order]) > 0
    return ends, rates, units, bool(usable)


def _fit(x: np.ndarray, y: np.ndarray, seed: int, restarts: int) -> Any:
    """A GP fitted to ``(x, y)``: amplitude × Matern-5/2 with one length scale per input, plus noise."""
    gp, kernels = _sklearn()
    kernel = (kernels.ConstantKernel(1.0, (1e-3, 1e3))
              * kernels.Matern(np.ones(x.shape[1]), (1e-2, 1e2), nu=2.5)
              + kernels.WhiteKernel(0.1, (1e-6, 1e1)))
    model = gp.GaussianProcessRegressor(kernel, normalize_y=False, n_restarts_optimizer=restarts,
                                        random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", importlib.import_module("sklearn.exceptions").ConvergenceWarning)
        return model.fit(x, y)


def _condition(model: Any, x: np.ndarray, y: np.ndarray, pending: np.ndarray, pending_noise: float) -> Any:
    """The fitted GP's latent function (its kernel without the white noise, which does not shrink with
    data) given the data and ``pending`` observed at the model's posterior mean (GP-BUCB's
    hallucination): the mean stays, the standard deviation shrinks around what members already try."""
    gp, _ = _sklearn()
    noise = float(model.kernel_.k2.noise_level)
    alpha = np.full(len(x) + len(pending), noise * pending_noise + _JITTER)
    alpha[: len(x)] = noise
    targets = np.concatenate([y, model.predict(pending)]) if len(pending) else y
    latent = gp.GaussianProcessRegressor(model.kernel_.k1, alpha=alpha, optimizer=None, normalize_y=False)
    return latent.fit(np.vstack([x, pending]), targets)


def _ucb(latent: Any, points: np.ndarray, kappa: float) -> np.ndarray:
    """Posterior mean plus ``kappa`` posterior standard deviations of the latent function."""
    mean, std = latent.predict(points, return_std=True)
    return mean + kappa * std


def _acquire(latent: Any, now: float, dims: int, kappa: float, candidates: int,
             gen: np.random.Generator) -> np.ndarray:
    """The unit hyper-parameters of the best candidate at time ``now``: ``candidates`` uniform points,
    then a quarter as many scattered around the best of them (the best kept among them)."""

    def best_of(pool: np.ndarray) -> np.ndarray:
        scores = _ucb(latent, np.column_stack([np.full(len(pool), now), pool]), kappa)
        return pool[int(np.argmax(scores))]

    first = best_of(gen.random((candidates, dims)))
    local = np.clip(first + gen.normal(0.0, _REFINE_SD, (max(candidates // 4, 1), dims)), 0.0, 1.0)
    return best_of(np.vstack([first, local]))


def _suggest(ends: np.ndarray, rates: np.ndarray, units: np.ndarray, pending: np.ndarray, clock: float,
             options: PB2, gen: np.random.Generator) -> np.ndarray:
    """Unit hyper-parameters maximising the UCB of the change rate at ``clock``. Time is an input
    scaled to [0, 1] over the window's ends and ``clock``; its learned length scale lets old
    intervals count less, the part PB2's time-varying kernel plays."""
    low = float(ends.min())
    span = max(float(ends.max()), clock) - low
    span = span if span > 0 else 1.0
    now = (clock - low) / span
    x = np.column_stack([(ends - low) / span, units])
    y = np.clip((rates - rates.mean()) / rates.std(), -_CLIP, _CLIP)  # std > 0: the data are usable
    model = _fit(x, y, int(gen.integers(2**31 - 1)), options.restarts)
    waiting = np.column_stack([np.full(len(pending), now), pending])
    latent = _condition(model, x, y, waiting, options.pending_noise)
    return _acquire(latent, now, units.shape[1], options.ucb_weight(len(y)), options.candidates, gen)


def pb2_explore(hparams: Mapping[str, Any], space: Mapping[str, SpaceEntry], observations: Sequence[Observation],
                clock: float, rng: RngLike, *, pending: Sequence[Mapping[str, Any]] = (),
                options: PB2 | None = None, perturb: Sequence[float] = (0.8, 1.2),
                resample_prob: float = 0.25) -> dict[str, Any]:
    """New hyper-parameters for a replaced agent (``hparams``: the donor's, which it inherits).

    The keys whose ``space`` entry is :class:`Continuous` or :class:`Integer` are chosen together by
    the model: a GP fitted to the latest ``options.window`` observations, each an interval's change
    per unit of clock (Ray's PB2 divides by the interval's length too) given its end clock and
    hyper-parameters (log declarations on a log scale, every input scaled to [0, 1] by its bounds),
    picks the point with the highest upper confidence bound at ``clock``. ``pending``, the
    hyper-parameters other members train with now, count as observed at the model's prediction,
    which lowers the bound around them. Every other key (Categorical, lists, samplers, undeclared)
    goes through :func:`explore` with ``rng``, ``perturb`` and ``resample_prob``: PB2 models
    continuous bounds only, as Ray's PB2 does.

    With fewer than two observations, or all their changes (or changes per unit of clock) equal,
    there is nothing to model and every key goes through :func:`explore`. Every value lies within
    its declaration, Integer values are ints; the same inputs and seed give the same result.
    ConfigError for a space key ``hparams`` lacks, a value outside its declaration, an observation
    (or pending entry) without a modelled key or outside its bounds, ``end <= start``, a non-finite
    change, or scikit-learn missing (checked on every call, the fallback's too, so that a missing
    install shows at the first replacement rather than once data arrive).
    """
    options = PB2() if options is None else options
    _check_inputs(hparams, space, clock, perturb, resample_prob, options)
    _sklearn()
    modelled = {k: e for k, e in space.items() if isinstance(e, (Continuous, Integer))}
    gen = as_generator(rng, "pb2_explore")
    ends, rates, units, usable = _dataset(observations, modelled, options.window)
    waiting = np.array([_check_point(p, modelled, f"pending[{i}]") for i, p in enumerate(pending)],
                       dtype=np.float64).reshape(len(pending), len(modelled))
    if not modelled or not usable:
        return explore(hparams, gen, perturb, resample_prob, space)
    rest = explore({k: v for k, v in hparams.items() if k not in modelled}, gen, perturb, resample_prob,
                   {k: e for k, e in space.items() if k not in modelled})
    best = _suggest(ends, rates, units, waiting, float(clock), options, gen)
    chosen = {key: _from_unit(u, entry) for (key, entry), u in zip(modelled.items(), best)}
    return {key: chosen[key] if key in chosen else rest[key] for key in hparams}
