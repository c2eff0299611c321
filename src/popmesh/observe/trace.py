"""Reading a merged trace timeline back: per-rank phase timings, and the straggler report from spans.

A run traced with ``popmesh launch --trace DIR`` (or ``init(trace=DIR)``) leaves ``DIR/trace.json``, a
Chrome trace event file (:mod:`popmesh.core.trace`). :func:`span_timings` turns its spans into the
``all_timing`` form the reports take (one ``{phase: [seconds, ...]}`` per rank), so
:func:`imbalance_from_trace` names, per phase, the slowest rank and the wait it caused the others from
the same spans the timeline shows: the user's ``Timer`` sections (category ``timer``) and the
population policies' phases (``population``) by default. Pure: nothing here communicates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.core.trace import MERGED_NAME
from popmesh.observe.reports import ImbalanceReport, imbalance_report

__all__ = ["load_trace", "span_timings", "imbalance_from_trace", "PHASE_CATEGORIES"]

PHASE_CATEGORIES = ("timer", "population")  # the spans that are phases of an iteration, not single calls

Trace = Mapping[str, Any] | str | os.PathLike[str]


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A merged trace file (``trace.json``) as a dict with ``traceEvents``; ConfigError if it is not one."""
    folder = Path(path)
    file = folder / MERGED_NAME if folder.is_dir() else folder
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the trace {file} ({e}): give the trace.json that "
                          "`popmesh launch --trace DIR` or init(trace=DIR) wrote") from e
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{file} is not a Chrome trace event file (no traceEvents list)")
    return data


def _events(trace: Trace) -> list[Mapping[str, Any]]:
    data = trace if isinstance(trace, Mapping) else load_trace(trace)
    return [e for e in data["traceEvents"] if isinstance(e, Mapping) and e.get("ph") == "X"]


def span_timings(trace: Trace, *, categories: Collection[str] | None = PHASE_CATEGORIES,
                 names: Collection[str] | None = None, size: int | None = None) -> list[dict[str, list[float]]]:
    """Per rank (index = pid), ``{span name: [seconds, ...]}`` in start order, for the report functions.

    ``categories`` / ``names`` select spans (None: all). ``size``: the number of ranks (default: the
    highest rank seen plus one); a rank without spans gets an empty dict.
    """
    spans = [e for e in _events(trace)
             if (categories is None or e.get("cat") in categories) and (names is None or e.get("name") in names)]
    ranks = max((int(e["pid"]) for e in spans), default=-1) + 1 if size is None else size
    out: list[dict[str, list[float]]] = [{} for _ in range(ranks)]
    for event in sorted(spans, key=lambda e: float(e["ts"])):
        rank = int(event["pid"])
        if 0 <= rank < ranks:
            out[rank].setdefault(str(event["name"]), []).append(float(event["dur"]) / 1e6)
    return out


def imbalance_from_trace(trace: Trace, *, categories: Collection[str] | None = PHASE_CATEGORIES,
                         names: Collection[str] | None = None) -> ImbalanceReport:
    """The load-imbalance report of the trace's phases: per phase the waiting, the slowest rank and the
    wait it caused the others (:class:`~popmesh.observe.reports.StepImbalance`)."""
    data = trace if isinstance(trace, Mapping) else load_trace(trace)
    meta = data.get("metadata", {})
    size = None
    if isinstance(meta, Mapping) and meta.get("ranks") is not None:
        size = max([*meta.get("ranks", []), *meta.get("missing_ranks", [])], default=-1) + 1
    timings = span_timings(data, categories=categories, names=names, size=size)
    if not timings:
        raise ConfigError("the trace holds no spans of the categories asked for "
                          f"({', '.join(categories) if categories else 'any'}); time phases with popmesh's Timer")
    return imbalance_report(timings)
