"""A JSONL event log of replacements: one line per replaced agent, appended atomically.

Several ranks may share one file: each line is written with a single ``write`` on a file opened
with ``O_APPEND``, so lines from different processes never interleave on a local file system. Put
``{rank}`` in the path to get one file per rank instead.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.population.mechanisms.info import json_number

__all__ = ["EventLog", "replacement_event"]


class EventLog:
    """Append-only JSONL writer; ``path`` may contain ``{rank}``. Thread-safe; closes itself."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        text = os.fspath(path)
        try:
            self.path = text.format(rank=rank)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"events_path {text!r} may only contain the placeholder {{rank}}") from e
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line (``time`` is added if missing)."""
        line = json.dumps({"time": time.time(), **record}, allow_nan=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._fd is None:
                raise ConfigError(f"event log {self.path} is closed")
            os.write(self._fd, line.encode())

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def replacement_event(policy: str, iteration: int, decision_iteration: int | None, rank: int,
                      donors: Sequence[int], weights: Sequence[float], metrics: Mapping[int, float],
                      strategy: str | None, optimizer: str | None, reason: str = "",
                      report_iterations: Mapping[int, int] | None = None,
                      hparams: Mapping[str, Any] | None = None,
                      inherited: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record of one replaced agent (global ranks; non-finite metrics as null); with
    ``report_iterations``, each compared member's reported iteration when it was decided; with
    ``hparams`` (``{name: [old, new]}``) and ``inherited``, the explored values (JSON values)."""
    record = {
        "event": "replace", "policy": policy, "iteration": int(iteration),
        "decision_iteration": decision_iteration, "rank": int(rank), "donors": [int(d) for d in donors],
        "weights": [float(w) for w in weights], "strategy": strategy, "optimizer": optimizer,
        "metrics": {str(r): json_number(m) for r, m in sorted(metrics.items())}, "reason": reason,
    }
    if report_iterations:
        record["report_iterations"] = {str(r): int(i) for r, i in sorted(report_iterations.items())}
    if hparams:
        record["hparams"] = {k: [_jsonable(v) for v in pair] for k, pair in hparams.items()}
    if inherited:
        record["inherited"] = {k: _jsonable(v) for k, v in inherited.items()}
    return record


def _jsonable(value: Any) -> Any:
    """A hyper-parameter value as JSON keeps it: numbers and strings as they are, the rest as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return json_number(value)
    return list(value) if isinstance(value, tuple) else str(value)
