"""The weight transfer of spawn_policy's MPI one-sided policies, over popmesh's snapshot windows.

torchgfn's ``...mpi4pyGeneral``/``...mpi4pyFast`` expose every rank's parameters in MPI windows and
let a dying rank read random donors' parameters without the donors taking part. Here each rank
publishes one tear-free snapshot (its parameters and its latest metric) into the engine's
:class:`~popmesh.engines.base.SnapshotWindow`, or, on a torch world that mpiexec started, into one on
the world's MPI side (:mod:`popmesh.compat._mpi_side`); the decisions stay in the facade, as in torchgfn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popmesh.comm.collectives import all_gather, barrier
from popmesh.comm.world import Comm
from popmesh.compat._mpi_side import window_opener as side_window_opener
from popmesh.compat._mpi_side import without_mpi
from popmesh.core.errors import ConfigError
from popmesh.engines.base import SnapshotWindow
from popmesh.engines.mpi.devices import require_host
from popmesh.population import SelectiveOptions, Strategy, averaging_weights, combine
from popmesh.population.mechanisms.info import Clock
from popmesh.population.state.model_state import layout_of, model_tensors, pack_bytes, refresh_, snapshot, unpack_bytes
from popmesh.population.state.replace import apply_replacement

__all__ = ["Exposure", "window_opener", "donor_weights", "replace_from"]


def window_opener(comm: Comm) -> Callable[[int], SnapshotWindow]:
    """How to open a snapshot window of ``nbytes`` per member over ``comm``: the engine's own (MPI), or
    one on the MPI side of a torch world that mpiexec started; ConfigError saying how to launch
    where neither exists."""
    engine = comm.world.engine
    if engine.one_sided:
        return lambda nbytes: engine.snapshot_window(comm.handle, nbytes)
    side = side_window_opener(comm)
    if side is None:
        raise ConfigError(without_mpi(comm.world, "the MPI one-sided spawn policies (AsyncSelectiveAveraging"
                                      "Policympi4pyFast/General)")
                          + "; or use AsyncSelectiveAveragingPolicy, which runs on every engine")
    return side


class Exposure:
    """This rank's window over ``comm``, holding its latest parameters and metric.

    Creating it is collective over ``comm`` (every member with a model of the same layout); it
    publishes the first snapshot and waits for every member to have done the same, so a read never
    finds an empty window. Later :meth:`publish` and :meth:`read` calls are local. A model on a
    GPU is refused (ConfigError) before the window is made: MPICH from PyPI is not CUDA-aware.
    """

    def __init__(self, comm: Comm, model: Any, iteration: int, metric: float) -> None:
        open_window = window_opener(comm)
        tensors = model_tensors(model)
        # MPI windows (the engine's or the MPI side's) hold host memory: a GPU model is refused before they are made
        require_host(next(iter(tensors.values())), "the MPI one-sided spawn policies (on the torch engine: "
                     "AsyncSelectiveAveragingPolicy)")
        self.flat = snapshot(tensors, layout_of(tensors))
        layout = self.flat.layout
        mine = np.array([layout.fingerprint(), layout.nbytes], dtype=np.int64)
        rows = all_gather(mine, group=comm)
        if np.any(rows != rows[0]):
            listing = "; ".join(f"rank {r}: {row.tolist()}" for r, row in zip(comm.ranks, rows))
            raise ConfigError(f"the models' parameters differ across the group ([layout hash, bytes] {listing}); "
                              f"this rank has {layout.describe()}: every rank must build the same architecture")
        self.comm = comm
        self.window = open_window(layout.nbytes)
        self.staging = np.zeros(layout.nbytes, dtype=np.uint8)
        self.publish(model, iteration, metric)
        barrier(group=comm)

    def publish(self, model: Any, iteration: int, metric: float) -> None:
        """Make ``model``'s current parameters and ``metric`` what the other ranks read."""
        refresh_(self.flat, model_tensors(model))
        pack_bytes(self.flat, self.staging)
        self.window.publish(self.staging, int(iteration), float(metric))

    def read(self, group_rank: int) -> tuple[dict[str, np.ndarray], float]:
        """Group rank ``group_rank``'s latest parameters (per-dtype flat arrays) and metric."""
        seen = self.window.read(group_rank, self.comm.timeout)
        if seen is None:  # the constructor's barrier rules this out
            raise ConfigError(f"group rank {group_rank} has published nothing yet")
        return unpack_bytes(self.flat.layout, seen.data), seen.metric

    def close(self) -> None:
        """Free the window; collective over the group, idempotent."""
        self.window.free()


def donor_weights(metrics: Sequence[float], strategy: Strategy) -> tuple[float, ...]:
    """One weight per donor for ``strategy`` from the donors' published metrics (higher is better).

    ``mean``: equal weights. ``weighted_mean`` and ``best_only`` weigh the donors with a finite
    metric (:func:`~popmesh.population.averaging_weights`), the others get 0; when none is finite,
    equal weights.
    """
    n = len(metrics)
    finite = [i for i, m in enumerate(metrics) if np.isfinite(m)]
    if strategy is Strategy.MEAN or not finite:
        return (1.0 / n,) * n
    weights = dict(zip(finite, averaging_weights([metrics[i] for i in finite], range(len(finite)), strategy)))
    return tuple(weights.get(i, 0.0) for i in range(n))


def replace_from(exposure: Exposure, donors: Sequence[int], options: SelectiveOptions, model: Any, optimizer: Any,
                 iteration: int, clock: Clock) -> tuple[Any, tuple[float, ...], str]:
    """Replace this rank's agent in place by ``donors``' (group ranks) parameters combined per
    ``options`` (strategy, momentum; ``reset_weights``: fresh ones from the model builder).
    Returns the optimizer to use, the donors' weights and what happened to the optimizer state."""
    combined: Any = None
    weights: tuple[float, ...] = ()
    if options.strategy is not Strategy.RESET:
        reads = [exposure.read(d) for d in donors]
        weights = donor_weights([m for _, m in reads], options.strategy)
        combined = combine([w for w, _ in reads], weights)
    clock.lap("read")
    applied = apply_replacement(options, model, optimizer, combined, iteration=int(iteration),
                                rank=exposure.comm.rank)
    clock.lap("apply")
    return applied.optimizer, weights, applied.optimizer_text
