"""OneSidedAveraging: replacement through MPI one-sided windows; nobody waits for anybody.

Every rank exposes one byte window holding its latest snapshot (parameters, optional floating
buffers, and its optimizer state when ``optimizer_policy='copy'``) together with its metric. At a
decision point a rank publishes its own snapshot, reads every peer's metric from their windows,
runs the pure :func:`~popmesh.population.decide` on what it sees, and, if it is among the replaced,
reads its donors' snapshots and combines them. Donors never take part: the engine layer
(the engine's :class:`~popmesh.engines.base.SnapshotWindow`; MPI's in
:mod:`popmesh.engines.mpi.window`) makes reads tear-free with double buffering and a sequence counter.

Each rank decides for itself from possibly stale metrics (a peer's latest publication), so two
ranks may momentarily see different populations; a rank acts only on its own replacement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from popmesh.comm.collectives import all_gather
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import OptimizerPolicy, combine
from popmesh.population.decisions.decision import Decision
from popmesh.population.decisions.options import SelectiveOptions, check_metric
from popmesh.population.decisions.selection import SelectionState, update_state
from popmesh.population.mechanisms.info import Clock, PolicyInfo
from popmesh.population.mechanisms.policy import PopulationPolicy
from popmesh.population.state.model_state import (
    FlatState,
    Layout,
    from_numpy,
    layout_of,
    model_tensors,
    optimizer_tensors,
    pack_bytes,
    refresh_,
    snapshot,
    tensors_of,
    unpack_bytes,
)
from popmesh.population.state.replace import apply_replacement

__all__ = ["OneSidedAveraging"]


@dataclass
class _Exposure:
    """One group's window and the layouts of what is published into it."""

    window: Any
    params: FlatState
    optim: Layout | None
    staging: np.ndarray

    def publish(self, tensors: dict[str, Any], optimizer: Any, iteration: int, metric: float) -> None:
        refresh_(self.params, tensors)
        split = self.params.layout.nbytes
        pack_bytes(self.params, self.staging[:split])
        if self.optim is not None:
            state = optimizer_tensors(optimizer)
            if list(state) != [e.name for e in self.optim.entries]:
                raise ConfigError("the optimizer's state changed shape since the window was created; "
                                  "optimizer_policy='copy' needs a fixed optimizer")
            pack_bytes(snapshot(state, self.optim), self.staging[split:])
        self.window.publish(self.staging, iteration, metric)

    def weights(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        return unpack_bytes(self.params.layout, raw[:self.params.layout.nbytes])

    def optimizer_state(self, raw: np.ndarray, optim: Layout) -> dict[str, Any]:
        arrays = unpack_bytes(optim, raw[self.params.layout.nbytes:])
        return tensors_of(from_numpy(optim, arrays))


class OneSidedAveraging(PopulationPolicy):
    """Selective averaging over MPI one-sided windows (the mpi engine only).

    Same options as :class:`SelectiveAveraging` (``rule``, ``donor_rule``, ``strategy``,
    ``momentum``, ``optimizer_policy``, ...), plus ``read_timeout`` (seconds to obtain a consistent
    copy of a window; default the world's timeout). Rules are applied by every rank to the metrics
    it reads, so ``seed`` keeps random donor draws identical across ranks that see the same metrics.

    Cross-rank contract: the **first** decision-point call is collective (it creates the windows
    over ``group`` and checks that every model has the same layout); later calls are local, and
    ranks may reach them at any time. :meth:`close` is collective. With ``optimizer_policy='copy'``
    the first call must come after the optimizer's first step (its state must exist).

    The windows hold host memory and the MPI engine is not CUDA-aware: a model on a GPU raises
    ConfigError at every call, before anything is exposed (the engine's ``require_host``); keep
    the model on the CPU, or use AsyncSelectiveAveraging on the torch engine.
    """

    name = "one_sided"

    def __init__(self, every: int, *, read_timeout: float | None = None, **options: Any) -> None:
        self.options = SelectiveOptions.build(every, options, "OneSidedAveraging")
        self.read_timeout = read_timeout
        self._exposures: dict[tuple[int, ...], _Exposure] = {}
        self._states: dict[tuple[int, ...], SelectionState] = {}
        self.every, self.events_path = self.options.every, self.options.events_path

    def _step(self, comm: Comm, iteration: int, is_due: bool, model: Any, optimizer: Any,
              local_metric: float | None) -> tuple[Any, Any, PolicyInfo]:
        """Publish, decide on what this rank sees, and replace this rank if it is among the worst."""
        clock = Clock()
        exposure, metric = self._publish(comm, iteration, model, optimizer, local_metric)
        clock.lap("publish")
        metrics = self._read_metrics(comm, exposure, metric)
        decision = self._decide(comm, metrics, iteration)
        clock.lap("decide")
        info = PolicyInfo(iteration, self.name, acted=True, decision_iteration=iteration,
                          strategy=decision.strategy, summary=decision.summary_in(comm.ranks),
                          metrics=dict(zip(comm.ranks, metrics)))
        if comm.group_rank in decision.replaced:
            optimizer = self._replace(comm, exposure, decision, model, optimizer, info, clock)
        info.timings = clock.laps
        return model, optimizer, info

    def publish(self, iteration: int, model: Any, optimizer: Any = None, local_metric: float | None = None,
                group: Comm | None = None) -> None:
        """Expose this rank's current weights and metric without deciding anything (e.g. every
        iteration, to keep what peers read fresh). Collective only on the first use for ``group``."""
        comm = resolve_group(group)
        if comm.size > 1:
            self._publish(comm, int(iteration), model, optimizer, local_metric)

    def _publish(self, comm: Comm, iteration: int, model: Any, optimizer: Any,
                 local_metric: float | None) -> tuple[_Exposure, float]:
        comm.require_member("OneSidedAveraging")
        metric = check_metric(local_metric, iteration)
        tensors = model_tensors(model, self.options.include_buffers)
        require_host = getattr(comm.world.engine, "require_host", None)  # windows of host memory (MPI)
        if require_host is not None:  # a model on a GPU is refused here, before any collective
            require_host(next(iter(tensors.values())),
                         "OneSidedAveraging (on the torch engine: AsyncSelectiveAveraging)")
        exposure = self._exposure(comm, tensors, optimizer)
        exposure.publish(tensors, optimizer, iteration, metric)
        return exposure, metric

    def _exposure(self, comm: Comm, tensors: dict[str, Any], optimizer: Any) -> _Exposure:
        found = self._exposures.get(comm.ranks)
        if found is not None:
            return found
        engine = comm.world.engine
        if not engine.one_sided:
            raise ConfigError(f"OneSidedAveraging needs one-sided windows, which the mpi engine has; this world "
                              f"runs on {engine.name!r}: launch under mpiexec or popmesh.init(engine='mpi'), "
                              "or use AsyncSelectiveAveraging, which runs on every engine")
        params = snapshot(tensors, layout_of(tensors))
        optim = self._optimizer_layout(optimizer)
        nbytes = params.layout.nbytes + (0 if optim is None else optim.nbytes)
        self._check_layouts(comm, params.layout, optim, nbytes)
        window = engine.snapshot_window(comm.handle, nbytes)
        exposure = _Exposure(window, params, optim, np.zeros(nbytes, dtype=np.uint8))
        self._exposures[comm.ranks] = exposure
        return exposure

    def _optimizer_layout(self, optimizer: Any) -> Layout | None:
        if self.options.optimizer_policy is not OptimizerPolicy.COPY:
            return None
        state = optimizer_tensors(optimizer) if optimizer is not None else {}
        if not state:
            raise ConfigError("optimizer_policy='copy' publishes the optimizer state, which does not exist "
                              "yet: pass the optimizer and make the first policy call after its first step")
        return layout_of(state)

    def _check_layouts(self, comm: Comm, params: Layout, optim: Layout | None, nbytes: int) -> None:
        mine = np.array([params.fingerprint(), 0 if optim is None else optim.fingerprint(), nbytes], np.int64)
        rows = all_gather(mine, group=comm, timeout=self.options.timeout)
        if np.any(rows != rows[0]):
            per_rank = "; ".join(f"rank {g}: {row.tolist()}" for g, row in zip(comm.ranks, rows))
            raise ConfigError(f"model or optimizer layouts differ across the group ([params, optimizer, bytes] "
                              f"{per_rank}); this rank has {params.describe()}. Use one architecture.")

    def _timeout(self, comm: Comm) -> float:
        return comm.timeout if self.read_timeout is None else float(self.read_timeout)

    def _read_metrics(self, comm: Comm, exposure: _Exposure, own: float) -> list[float]:
        """Each member's latest published metric; NaN for a member that has published nothing."""
        out = []
        for g in range(comm.size):
            if g == comm.group_rank:
                out.append(own)
                continue
            seen = exposure.window.read(g, self._timeout(comm), with_data=False)
            out.append(math.nan if seen is None else seen.metric)
        return out

    def _decide(self, comm: Comm, metrics: list[float], iteration: int) -> Decision:
        state = self._states.get(comm.ranks) or self.options.init_state(comm.size)
        decision = self.options.decide(metrics, iteration, state)
        self._states[comm.ranks] = update_state(state, decision.replaced, iteration)
        return decision

    def _replace(self, comm: Comm, exposure: _Exposure, decision: Decision, model: Any, optimizer: Any,
                 info: PolicyInfo, clock: Clock) -> Any:
        me = comm.group_rank
        donors, weights = decision.donors[me], decision.weights[me]
        raw = {d: exposure.window.read(d, self._timeout(comm)).data for d in donors}
        combined = combine([exposure.weights(raw[d]) for d in donors], weights) if donors else None
        source = decision.copy_optimizer_from[me]
        donor_state = None
        if source is not None and exposure.optim is not None:
            donor_state = exposure.optimizer_state(raw[source], exposure.optim)
        clock.lap("read")
        applied = apply_replacement(self.options, model, optimizer, combined, iteration=info.iteration,
                                    rank=comm.rank, donor_state=donor_state,
                                    source=None if source is None else comm.ranks[source])
        clock.lap("apply")
        info.replaced, info.donors, info.weights = True, tuple(comm.ranks[d] for d in donors), weights
        info.optimizer, info.hparams = applied.optimizer_text, applied.hparams
        self._log_replacement(comm, info, decision.reasons.get(me, ""))
        return applied.optimizer

    def close(self) -> None:
        """Free every window. Collective over each group the policy was used with; idempotent."""
        exposures, self._exposures = self._exposures, {}
        for exposure in exposures.values():
            exposure.window.free()
