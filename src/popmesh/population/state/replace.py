"""Replacing this rank's agent in place: new weights (with momentum), optimizer state, exploration.

Local work only, shared by every mechanism once the donors' combined weights are here. The model
object is kept (its tensors are overwritten in place), so references held elsewhere stay valid; the
optimizer is a new object only when ``optimizer_builder`` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import OptimizerPolicy, apply_momentum
from popmesh.population.decisions.options import Explore, SelectiveOptions
from popmesh.population.state.model_state import (
    Layout,
    from_numpy,
    layout_of,
    load_,
    load_optimizer_tensors_,
    model_tensors,
    snapshot,
    to_numpy,
)

__all__ = ["Applied", "fresh_weights", "install_weights", "reset_optimizer", "set_hparams", "apply_replacement"]


@dataclass
class Applied:
    """What :func:`apply_replacement` did: the optimizer to return and how its state was treated."""

    optimizer: Any
    optimizer_text: str
    hparams: dict[str, list[Any]] = field(default_factory=dict)


def fresh_weights(model_builder: Any, include_buffers: bool, layout: Layout) -> dict[str, np.ndarray]:
    """Per-dtype numpy weights of a brand-new model from ``model_builder()`` (same layout required)."""
    tensors = model_tensors(model_builder(), include_buffers)
    if layout_of(tensors) != layout:
        raise ConfigError("model_builder() returned a model with other tensors than the one being replaced "
                          f"({layout_of(tensors).describe()} vs {layout.describe()}): it must build the same "
                          "architecture")
    return to_numpy(snapshot(tensors))


def install_weights(tensors: Mapping[str, Any], layout: Layout, combined: Mapping[str, np.ndarray],
                    momentum: float) -> None:
    """Write ``momentum·own + (1 − momentum)·combined`` into ``tensors`` in place."""
    device = next(iter(tensors.values())).device
    if momentum > 0:
        own = to_numpy(snapshot(tensors, layout))
        combined = apply_momentum(own, {dt: np.asarray(combined[dt]).astype(own[dt].dtype) for dt in own},
                                  momentum)
    load_(tensors, from_numpy(layout, combined, device))


def reset_optimizer(model: Any, optimizer: Any, builder: Any) -> tuple[Any, str]:
    """A fresh optimizer from ``builder(model)``, or, without a builder, ``optimizer`` with its
    per-parameter state (moments, step counts) cleared and its hyper-parameters kept."""
    if builder is not None:
        return builder(model), "rebuilt"
    if optimizer is not None:
        optimizer.state.clear()
    return optimizer, "reset"


def _optimizer(opts: SelectiveOptions, model: Any, optimizer: Any, donor_state: Mapping[str, Any] | None,
               source: int | None) -> tuple[Any, str]:
    policy = opts.optimizer_policy
    if policy is OptimizerPolicy.KEEP:
        return optimizer, "keep"
    if policy is OptimizerPolicy.COPY and source is not None:
        if optimizer is None:
            raise ConfigError("optimizer_policy='copy' needs the optimizer: pass it to the policy call")
        if donor_state:
            load_optimizer_tensors_(optimizer, donor_state)
            return optimizer, f"copied from {source}"
        new_opt, text = reset_optimizer(model, optimizer, opts.optimizer_builder)
        return new_opt, f"{text} (rank {source} had no optimizer state to copy)"
    return reset_optimizer(model, optimizer, opts.optimizer_builder)


def set_hparams(optimizer: Any, values: Mapping[str, Any], explore: Explore | None = None) -> None:
    """Write ``values`` into every param group of ``optimizer`` that ``explore`` explores (all without
    it) and has the key (the others are the training loop's to adopt, from :attr:`PolicyInfo.hparams`)."""
    groups = explore.groups(optimizer) if explore is not None else getattr(optimizer, "param_groups", ())
    for group in groups:
        for key, value in values.items():
            if key in group:
                group[key] = value


def apply_replacement(opts: SelectiveOptions, model: Any, optimizer: Any,
                      combined: Mapping[str, np.ndarray] | None, *, iteration: int, rank: int,
                      donor_state: Mapping[str, Any] | None = None, source: int | None = None,
                      assigned: Mapping[str, Any] | None = None, previous: Mapping[str, Any] | None = None) -> Applied:
    """Replace this rank's agent: ``combined`` weights (None: fresh ones from ``model_builder``),
    then the optimizer per ``opts.optimizer_policy`` (``source``: donor whose state to copy), then
    the hyper-parameters: the ``assigned`` values (the coordinator's exploit and explore; ``previous``:
    this agent's values before), else this rank's own explore step if configured."""
    tensors = model_tensors(model, opts.include_buffers)
    layout = layout_of(tensors)
    if combined is None:
        combined = fresh_weights(opts.model_builder, opts.include_buffers, layout)
    install_weights(tensors, layout, combined, opts.momentum)
    new_opt, text = _optimizer(opts, model, optimizer, donor_state, source)
    if assigned is not None:
        set_hparams(new_opt, assigned, opts.explore)
        before = {} if previous is None else previous
        return Applied(new_opt, text, {k: [before.get(k), v] for k, v in assigned.items()})
    hparams = {} if opts.explore is None or new_opt is None else opts.explore.apply(new_opt, opts.seed,
                                                                                  iteration, rank)
    return Applied(new_opt, text, hparams)
