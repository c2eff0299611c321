"""AverageAll: every ``every`` iterations, every agent of the group takes the group's mean weights."""

from __future__ import annotations

import time
from typing import Any

from popmesh.comm.collectives import all_reduce_
from popmesh.comm.world import Comm, resolve_group
from popmesh.population.events import EventLog
from popmesh.population.info import PolicyInfo
from popmesh.population.model_state import load_, model_tensors, snapshot
from popmesh.population.options import check_every, due

__all__ = ["AverageAll"]


class AverageAll:
    """Plain model averaging over a group (torchgfn's ``AverageAllPolicy``, with its divisor bug fixed).

    On iterations that are multiples of ``every``, every parameter (and, with ``include_buffers``,
    every floating buffer such as BatchNorm statistics) becomes its mean over ``group``, divided by
    the **group's** size. Parameters of one dtype travel as one fused buffer.

    Cross-rank contract: every member of ``group`` calls with the same ``iteration`` and a model of
    the same architecture; ranks outside the group call nothing. Optimizer state is kept.
    """

    name = "average_all"

    def __init__(self, every: int, include_buffers: bool = False, *, events_path: str | None = None,
                 timeout: float | None = None) -> None:
        self.every = check_every(every)
        self.include_buffers = bool(include_buffers)
        self.events_path = events_path
        self.timeout = timeout
        self._events: EventLog | None = None

    def __call__(self, iteration: int, model: Any, optimizer: Any = None, local_metric: float | None = None,
                 group: Comm | None = None) -> tuple[Any, Any, PolicyInfo]:
        """Average on decision points; return ``(model, optimizer, info)`` (the same objects)."""
        if not due(iteration, self.every):
            return model, optimizer, PolicyInfo(int(iteration), self.name)
        comm = resolve_group(group)
        comm.require_member("AverageAll")
        start = time.perf_counter()
        tensors = model_tensors(model, self.include_buffers)
        flat = snapshot(tensors)
        all_reduce_(flat.buffers, "avg", group=comm, timeout=self.timeout)
        load_(tensors, flat)
        elapsed = time.perf_counter() - start
        self._log(comm, int(iteration))
        return model, optimizer, PolicyInfo(int(iteration), self.name, acted=True, averaged=True,
                                            summary=f"averaged over {comm.size} ranks {list(comm.ranks)}",
                                            timings={"average": elapsed})

    def _log(self, comm: Comm, iteration: int) -> None:
        if self.events_path is None or comm.rank != comm.ranks[0]:
            return
        if self._events is None:
            self._events = EventLog(self.events_path, comm.rank)
        self._events.write({"event": "average", "policy": self.name, "iteration": iteration,
                            "ranks": list(comm.ranks)})
