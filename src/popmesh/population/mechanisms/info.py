"""What a population policy call did on this rank: :class:`PolicyInfo`, returned by every call."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from popmesh.core import trace

__all__ = ["PolicyInfo", "Clock", "json_number"]


def json_number(x: float | None) -> float | None:
    """``x`` as a JSON-safe number: non-finite values (NaN, ±inf) become None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class PolicyInfo:
    """The outcome of one policy call on one rank. Ranks are global.

    * ``acted``: this call was a decision or averaging point (the cadence hit) for this rank.
    * ``averaged``: this rank's weights became the group average (:class:`AverageAll`).
    * ``replaced``: this rank's weights were replaced during this call; ``donors`` / ``weights``
      say by whom, ``strategy`` how, ``optimizer`` what happened to its optimizer state
      (``"reset"``, ``"rebuilt"``, ``"keep"``, ``"copied from <rank>"``).
    * ``decision_iteration``: the iteration whose metrics the applied decision came from (equal to
      ``iteration`` for synchronous policies, earlier for asynchronous ones).
    * ``summary``: the decision in one line; ``metrics``: the metrics it was based on, by global rank.
    * ``report_iterations``: the asynchronous policy's applied decision: each compared member's
      latest reported iteration when it was made, by global rank (how far behind the others were).
    * ``hparams``: a replaced agent's explored hyper-parameters, ``{name: [old, new]}``: train at the
      new values from now on (param-group fields are already set in the optimizer). ``inherited``:
      the donor's values before the explore step (``decide="latest"``).
    * ``timings``: seconds spent in each phase of this call on this rank.
    """

    iteration: int
    policy: str
    acted: bool = False
    averaged: bool = False
    replaced: bool = False
    donors: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    strategy: str | None = None
    optimizer: str | None = None
    decision_iteration: int | None = None
    summary: str = ""
    metrics: dict[int, float] = field(default_factory=dict)
    report_iterations: dict[int, int] = field(default_factory=dict)
    hparams: dict[str, list[Any]] = field(default_factory=dict)
    inherited: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def hparams_now(self) -> dict[str, Any]:
        """The values to train at after a replacement, ``{name: new}`` (empty when nothing changed)."""
        return {name: pair[1] for name, pair in self.hparams.items()}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (non-finite metrics become None, rank keys strings)."""
        out = asdict(self)
        out["donors"] = list(self.donors)
        out["weights"] = list(self.weights)
        out["metrics"] = {str(r): json_number(m) for r, m in self.metrics.items()}
        out["report_iterations"] = {str(r): int(i) for r, i in self.report_iterations.items()}
        return out


class Clock:
    """Seconds per phase of one call, for :attr:`PolicyInfo.timings`."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Record the time since the previous lap (or creation) under ``name`` (a span when tracing)."""
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        if trace.ACTIVE is not None:
            trace.ACTIVE.add(f"population.{name}", "population", int(self._last * 1e9), int(now * 1e9))
        self._last = now
