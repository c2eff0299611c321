"""SelectiveAveraging: synchronous replacement of weak agents by weighted averages of better ones.

Per decision point, on every member of the group: all_gather the metrics (with a fingerprint of
each model's layout), compute the same pure :func:`~popmesh.population.decide` (shared seed), then
move weights with collectives. Replaced ranks sharing the same donors and weights (the usual case:
"all others, equal weights") get their combination from **one** all_reduce of weighted
contributions, ``Σ_d w_d·θ_d``, whatever their number; a combination with a single donor is one
broadcast. Copying optimizer state is one broadcast per distinct source donor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from popmesh.comm.collectives import all_gather, all_reduce_, broadcast_, broadcast_object
from popmesh.comm.world import Comm
from popmesh.core.errors import ConfigError
from popmesh.population.decisions.decision import Decision
from popmesh.population.decisions.options import SelectiveOptions, check_metric
from popmesh.population.decisions.selection import SelectionState, state_from_json, state_to_json, update_state
from popmesh.population.mechanisms.info import Clock, PolicyInfo
from popmesh.population.mechanisms.policy import PopulationPolicy
from popmesh.population.state.model_state import (
    FlatState,
    Layout,
    layout_of,
    model_tensors,
    optimizer_tensors,
    snapshot,
    to_numpy,
)
from popmesh.population.state.replace import apply_replacement

__all__ = ["SelectiveAveraging", "combination_groups", "gather_metrics"]

Combination = tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]


def combination_groups(decision: Decision) -> list[Combination]:
    """``(donors, weights, recipients)`` per distinct combination of ``decision`` (group ranks),
    ordered by first recipient; ``reset_weights`` recipients need no transfer and are left out."""
    by_key: dict[tuple[tuple[int, ...], tuple[float, ...]], list[int]] = {}
    for r in decision.replaced:
        if decision.donors[r]:
            by_key.setdefault((decision.donors[r], decision.weights[r]), []).append(r)
    return [(d, w, tuple(rs)) for (d, w), rs in sorted(by_key.items(), key=lambda kv: kv[1][0])]


def gather_metrics(comm: Comm, metric: float, layout: Layout, timeout: float | None) -> list[float]:
    """Every member's metric (index = group rank); ConfigError on every rank if model layouts differ."""
    rows = all_gather(np.array([metric, float(layout.fingerprint())]), group=comm, timeout=timeout)
    prints = rows[:, 1]
    if np.any(prints != prints[0]):
        per_rank = ", ".join(f"rank {g}: {int(p):#x}" for g, p in zip(comm.ranks, prints))
        raise ConfigError(f"model layouts differ across the group ({per_rank}); this rank has "
                          f"{layout.describe()}. Every agent must have the same architecture.")
    return [float(m) for m in rows[:, 0]]


def _wide(buf: Any) -> Any:
    import torch

    return buf.float() if buf.dtype in (torch.float16, torch.bfloat16) else buf.clone()


def _transfer(comm: Comm, combo: Combination, flat: FlatState, timeout: float | None) -> FlatState:
    """Run one combination on every member; returns the combined buffers (meaningful on recipients)."""
    donors, weights, _ = combo
    me = comm.group_rank
    if len(donors) == 1:
        out = FlatState(flat.layout, {dt: b.clone() for dt, b in flat.buffers.items()})
        broadcast_(out.buffers, src=comm.ranks[donors[0]], group=comm, timeout=timeout)
        return out
    mine = dict(zip(donors, weights)).get(me, 0.0)
    contrib = {dt: _wide(b).mul_(mine) for dt, b in flat.buffers.items()}
    all_reduce_(contrib, "sum", group=comm, timeout=timeout)
    return FlatState(flat.layout, contrib)


class SelectiveAveraging(PopulationPolicy):
    """Replace the weakest agents of a group by weighted averages of better ones, synchronously.

    On iterations that are multiples of ``every``: ``rule`` (:class:`ReplacementRule`, default the
    worst quarter) picks who is replaced, ``donor_rule`` (default every valid other agent) picks
    donors, ``strategy`` (``mean``, ``weighted_mean`` with rank weights growing with quality,
    ``best_only``, ``reset_weights``) the weights. A replaced agent's new weights are
    ``momentum·own + (1 − momentum)·Σ w_d·θ_d``; its optimizer state follows ``optimizer_policy``
    (``reset`` by default: ``optimizer_builder(model)`` if given, else the state is cleared and the
    hyper-parameters kept; ``keep``; ``copy`` from the best donor, moments included). ``explore``
    perturbs the replaced agent's hyper-parameters. Metric: higher is better; NaN/inf never donate.

    Cross-rank contract: every member of ``group`` calls with the same ``iteration`` and a model
    of the same architecture; ranks outside the group call nothing. Returns
    ``(model, optimizer, info)``; use the returned optimizer (a new object if rebuilt).
    """

    name = "selective"

    def __init__(self, every: int, **options: Any) -> None:
        self.options = SelectiveOptions.build(every, options, "SelectiveAveraging")
        self.every, self.events_path = self.options.every, self.options.events_path
        self._states: dict[tuple[int, ...], SelectionState] = {}

    def state_dict(self) -> dict[str, Any]:
        """What the replacement rules remember (per group), as JSON values: for a checkpoint."""
        return {"selection": {",".join(map(str, ranks)): state_to_json(state) for ranks, state in self._states.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`state_dict` (from a checkpoint of the same population)."""
        self._states = {tuple(int(r) for r in key.split(",")): state_from_json(value)
                        for key, value in state.get("selection", {}).items()}

    def _step(self, comm: Comm, iteration: int, is_due: bool, model: Any, optimizer: Any,
              local_metric: float | None) -> tuple[Any, Any, PolicyInfo]:
        """Decide and replace on a decision point."""
        metric = check_metric(local_metric, iteration)
        clock = Clock()
        tensors = model_tensors(model, self.options.include_buffers)
        metrics = gather_metrics(comm, metric, layout_of(tensors), self.options.timeout)
        clock.lap("gather")
        decision = self._decide(comm, metrics, int(iteration))
        clock.lap("decide")
        combined, donor_state = self._move(comm, decision, tensors, optimizer)
        clock.lap("transfer")
        info = self._info(comm, decision, metrics, int(iteration))
        if comm.group_rank in decision.replaced:
            optimizer = self._apply(comm, decision, model, optimizer, combined, donor_state, info)
        clock.lap("apply")
        info.timings = clock.laps
        return model, optimizer, info

    def _decide(self, comm: Comm, metrics: list[float], iteration: int) -> Decision:
        state = self._states.get(comm.ranks) or self.options.init_state(comm.size)
        decision = self.options.decide(metrics, iteration, state)
        self._states[comm.ranks] = update_state(state, decision.replaced, iteration)
        return decision

    def _move(self, comm: Comm, decision: Decision, tensors: Mapping[str, Any],
              optimizer: Any) -> tuple[dict[str, np.ndarray] | None, dict[str, Any] | None]:
        me, combined, donor_state = comm.group_rank, None, None
        groups = combination_groups(decision)
        if groups:
            flat = snapshot(tensors)
            for combo in groups:
                out = _transfer(comm, combo, flat, self.options.timeout)
                if me in combo[2]:
                    combined = to_numpy(out)
        sources = sorted({s for s in decision.copy_optimizer_from.values() if s is not None})
        for s in sources:
            mine = (optimizer_tensors(optimizer) if optimizer is not None else {}) if me == s else None
            state = broadcast_object(mine, src=comm.ranks[s], group=comm, timeout=self.options.timeout)
            if me in decision.replaced and decision.copy_optimizer_from[me] == s:
                donor_state = state
        return combined, donor_state

    def _info(self, comm: Comm, decision: Decision, metrics: list[float], iteration: int) -> PolicyInfo:
        me = comm.group_rank
        info = PolicyInfo(iteration, self.name, acted=True, decision_iteration=iteration,
                          strategy=decision.strategy, summary=decision.summary_in(comm.ranks),
                          metrics={g: m for g, m in zip(comm.ranks, metrics)})
        if me in decision.replaced:
            info.replaced = True
            info.donors = tuple(comm.ranks[d] for d in decision.donors[me])
            info.weights = decision.weights[me]
        return info

    def _apply(self, comm: Comm, decision: Decision, model: Any, optimizer: Any,
               combined: dict[str, np.ndarray] | None, donor_state: dict[str, Any] | None,
               info: PolicyInfo) -> Any:
        me = comm.group_rank
        source = decision.copy_optimizer_from[me]
        applied = apply_replacement(self.options, model, optimizer, combined, iteration=info.iteration,
                                    rank=comm.rank, donor_state=donor_state,
                                    source=None if source is None else comm.ranks[source])
        info.optimizer, info.hparams = applied.optimizer_text, applied.hparams
        self._log_replacement(comm, info, decision.reasons.get(me, ""))
        return applied.optimizer

