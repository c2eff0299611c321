"""The skeleton every population policy shares: one call shape, one prologue, one event log.

A policy is called every iteration as ``policy(iteration, model, optimizer, local_metric, group)``
and returns ``(model, optimizer, info)``. What happens before a policy does its own work is the
same for all of them and lives here: the cadence check (a decision point is a multiple of
``every``), resolving and checking the group, and the shortcut for a group of one, which has
nobody to average with. A policy implements :meth:`PopulationPolicy._step` and, if it has work
between decision points (the asynchronous policy swaps in finished replacements),
:meth:`PopulationPolicy._idle`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from popmesh.comm.world import Comm, resolve_group
from popmesh.population.decisions.options import check_metric, due
from popmesh.population.mechanisms.events import EventLog, replacement_event
from popmesh.population.mechanisms.info import PolicyInfo

__all__ = ["PopulationPolicy"]


class PopulationPolicy(ABC):
    """Base of AverageAll, SelectiveAveraging, OneSidedAveraging and AsyncSelectiveAveraging.

    Cross-rank contract (every policy): every member of ``group`` calls with the same ``iteration``
    sequence and a model of the same architecture; ranks outside the group call nothing.
    """

    name = "policy"
    averages_all = False  # every decision point averages every member (a group of one: trivially)
    needs_metric = True  # a decision point needs local_metric (checked in a group of one too)
    every: int
    events_path: str | None = None
    _events: EventLog | None = None
    _last_group: Comm | None = None  # the ``group`` argument of the last call that did work

    def __call__(self, iteration: int, model: Any, optimizer: Any = None, local_metric: float | None = None,
                 group: Comm | None = None) -> tuple[Any, Any, PolicyInfo]:
        """Act on decision points (and, for the asynchronous policy, whenever a replacement is
        ready); return ``(model, optimizer, info)``. Use the returned optimizer: it is a new
        object when a replacement rebuilt it."""
        is_due = due(iteration, self.every)
        if not is_due and self._idle(group):
            return model, optimizer, PolicyInfo(int(iteration), self.name)
        comm = resolve_group(group)
        comm.require_member(type(self).__name__)
        iteration = int(iteration)
        if comm.size == 1:
            if is_due and self.needs_metric:
                check_metric(local_metric, iteration)
            return model, optimizer, PolicyInfo(iteration, self.name, acted=is_due,
                                                averaged=is_due and self.averages_all,
                                                summary="a group of one" if is_due else "")
        result = self._step(comm, iteration, is_due, model, optimizer, local_metric)
        self._last_group = group
        return result

    def _idle(self, group: Comm | None) -> bool:
        """Whether a call that is not a decision point has nothing to do (true unless overridden)."""
        return True

    @abstractmethod
    def _step(self, comm: Comm, iteration: int, is_due: bool, model: Any, optimizer: Any,
              local_metric: float | None) -> tuple[Any, Any, PolicyInfo]:
        """The policy's own work on a group of two or more, this rank a member."""

    def _log(self, comm: Comm, record: Mapping[str, Any]) -> None:
        """Append ``record`` to the events file (JSON lines) if the policy has one."""
        if self.events_path is None:
            return
        if self._events is None:
            self._events = EventLog(self.events_path, comm.rank)
        self._events.write(record)

    def _log_replacement(self, comm: Comm, info: PolicyInfo, reason: str) -> None:
        """Record that this rank was replaced, as ``info`` describes it."""
        if self.events_path is not None:
            self._log(comm, replacement_event(self.name, info.iteration, info.decision_iteration, comm.rank,
                                              info.donors, info.weights, info.metrics, info.strategy,
                                              info.optimizer, reason, info.report_iterations, info.hparams,
                                              info.inherited))
