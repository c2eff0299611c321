"""Timing reports across ranks: gather every rank's :class:`~popmesh.observe.reports.Timer`, then report.

:mod:`popmesh.observe.reports` computes and prints reports from per-rank timings without communicating;
this module adds the gathering. ``gather_timings`` is collective over ``group`` and adds no barrier
unless asked (torchgfn's ``--timing`` put barriers around timed sections, perturbing what it
measured). :func:`report_timings` and :func:`report_imbalance` take either already gathered timings
(one dict per rank, as torchgfn's ``report_time_info(all_timing_dict, world_size)``, whose facade
in :mod:`popmesh.compat.gfn` maps onto them) or this rank's Timer / dict plus a group, in which
case they gather first and only ``dst`` gets (and prints) the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from popmesh.comm.collectives import all_gather_object, gather_object
from popmesh.comm.collectives import barrier as _barrier
from popmesh.comm.world import Comm
from popmesh.core.errors import ConfigError
from popmesh.observe.reports import (
    ImbalanceReport,
    Timer,
    TimeReport,
    imbalance_report,
    print_report,
    save_chart,
    time_report,
)

__all__ = ["gather_timings", "report_timings", "report_imbalance"]

Timings = Timer | Mapping[str, Any]


def _local(timing: Timings) -> dict[str, Any]:
    if isinstance(timing, Timer):
        return timing.as_dict()
    if isinstance(timing, Mapping):
        return {str(k): list(v) if isinstance(v, (list, tuple)) else v for k, v in timing.items()}
    raise ConfigError(f"expected a Timer or a dict step -> seconds, got {type(timing).__name__}")


def gather_timings(timing: Timings, *, group: Comm | None = None, dst: int | None = 0,
                   barrier: bool = False, timeout: float | None = None) -> list[dict[str, Any]] | None:
    """Every rank's timings (``timer.as_dict()``), indexed by group rank, on global rank ``dst``.

    Collective over ``group``. ``dst=None`` gives the list to every rank; other ranks get None.
    ``barrier=True`` first waits for every rank (so the gather does not measure stragglers).
    """
    local = _local(timing)
    if barrier:
        _barrier(group=group, timeout=timeout)
    if dst is None:
        return all_gather_object(local, group=group, timeout=timeout)
    return gather_object(local, dst, group=group, timeout=timeout)


def _gathered(timing: Timings | Sequence[Mapping[str, Any]], group: Comm | None, dst: int | None,
              timeout: float | None) -> Sequence[Mapping[str, Any]] | None:
    if isinstance(timing, (Timer, Mapping)):
        return gather_timings(timing, group=group, dst=dst, timeout=timeout)
    if group is not None:
        raise ConfigError("pass group= only with this rank's Timer or dict; gathered timings need no group")
    return list(timing)


def report_timings(timing: Timings | Sequence[Mapping[str, Any]], world_size: int | None = None, *,
                   group: Comm | None = None, dst: int | None = 0, threshold: float = 0.7,
                   file: TextIO | None = None, chart: str | Path | None = None, show: bool = True,
                   timeout: float | None = None) -> TimeReport | None:
    """Per-step time across ranks (torchgfn ``report_time_info``): build, print, optionally save a PNG.

    ``timing`` is one dict per rank, or this rank's Timer/dict (then collective over ``group``;
    ranks other than ``dst`` get None). Returns the :class:`~popmesh.observe.reports.TimeReport`.
    """
    all_timing = _gathered(timing, group, dst, timeout)
    if all_timing is None:
        return None
    report = time_report(all_timing, world_size, threshold)
    if show:
        print_report(report, file=file)
    if chart is not None:
        save_chart(report, chart)
    return report


def report_imbalance(timing: Timings | Sequence[Mapping[str, Any]], world_size: int | None = None, *,
                     group: Comm | None = None, dst: int | None = 0, file: TextIO | None = None,
                     show: bool = True, timeout: float | None = None) -> ImbalanceReport | None:
    """Useful vs waiting time per step (torchgfn ``report_load_imbalance``): build and print.

    Same ``timing`` forms as :func:`report_timings`.
    """
    all_timing = _gathered(timing, group, dst, timeout)
    if all_timing is None:
        return None
    report = imbalance_report(all_timing, world_size)
    if show:
        print_report(report, file=file)
    return report
