"""AverageAll: every ``every`` iterations, every agent of the group takes the group's mean weights."""

from __future__ import annotations

import time
from typing import Any

from popmesh.comm.collectives import all_reduce_
from popmesh.comm.world import Comm
from popmesh.population.decisions.options import check_every
from popmesh.population.mechanisms.info import PolicyInfo
from popmesh.population.mechanisms.policy import PopulationPolicy
from popmesh.population.state.model_state import load_, model_tensors, snapshot

__all__ = ["AverageAll"]


class AverageAll(PopulationPolicy):
    """Plain model averaging over a group (torchgfn's ``AverageAllPolicy``, with its divisor bug fixed).

    On iterations that are multiples of ``every``, every parameter (and, with ``include_buffers``,
    every floating buffer such as BatchNorm statistics) becomes its mean over ``group``, divided by
    the **group's** size. Parameters of one dtype travel as one fused buffer.

    Cross-rank contract: every member of ``group`` calls with the same ``iteration`` and a model of
    the same architecture; ranks outside the group call nothing. Optimizer state is kept.
    """

    name = "average_all"
    averages_all = True
    needs_metric = False

    def __init__(self, every: int, include_buffers: bool = False, *, events_path: str | None = None,
                 timeout: float | None = None) -> None:
        self.every = check_every(every)
        self.include_buffers = bool(include_buffers)
        self.events_path = events_path
        self.timeout = timeout

    def _step(self, comm: Comm, iteration: int, is_due: bool, model: Any, optimizer: Any,
              local_metric: float | None) -> tuple[Any, Any, PolicyInfo]:
        """Average on decision points; the model and optimizer come back as the same objects."""
        start = time.perf_counter()
        tensors = model_tensors(model, self.include_buffers)
        flat = snapshot(tensors)
        all_reduce_(flat.buffers, "avg", group=comm, timeout=self.timeout)
        load_(tensors, flat)
        elapsed = time.perf_counter() - start
        if comm.rank == comm.ranks[0]:
            self._log(comm, {"event": "average", "policy": self.name, "iteration": iteration,
                             "ranks": list(comm.ranks)})
        return model, optimizer, PolicyInfo(iteration, self.name, acted=True, averaged=True,
                                            summary=f"averaged over {comm.size} ranks {list(comm.ranks)}",
                                            timings={"average": elapsed})
