"""Timing and load-imbalance reports over per-rank timings (pure part), and a local Timer.

Input everywhere is ``all_timing``: one mapping per rank (index = rank), ``{step name: [seconds
per iteration, ...]}``, as gathered from every rank's :meth:`Timer.as_dict`. A scalar counts as a
one-iteration list. Unlike torchgfn's ``report_time_info`` / ``report_load_imbalance`` these return
frozen dataclasses, tolerate ranks with different iteration counts (only the iterations every rank
has enter per-iteration statistics; the rest are counted as dropped) and steps missing on some
ranks (reported, not fatal). Printing uses ``rich`` when installed; charts use matplotlib's Agg
canvas. Both are imported only when used.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from popmesh.core import trace
from popmesh.core.errors import ConfigError

__all__ = [
    "Timer",
    "StepTime",
    "TimeReport",
    "StepImbalance",
    "ImbalanceReport",
    "time_report",
    "imbalance_report",
    "format_report",
    "print_report",
    "save_chart",
]

TimingDict = Mapping[str, Sequence[float] | float]
Table = tuple[str, list[str], list[list[str]], list[str]]


class Timer:
    """Named wall-clock sections recorded on this rank; no communication (gather ``as_dict()`` yourself).

    ``with timer.section("rollout"): ...`` appends the elapsed seconds to ``"rollout"``, also when the
    body raises. One Timer per thread.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._times: dict[str, list[float]] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the body of the ``with`` block under ``name``."""
        start = self._clock()
        try:
            yield
        finally:
            self.record(name, self._clock() - start)

    def record(self, name: str, seconds: float) -> None:
        """Append one duration in seconds (finite, non-negative) to ``name``; a span ending now when tracing."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"timer section names must be non-empty strings, got {name!r}")
        self._times.setdefault(name, []).append(_duration(seconds, f"section {name!r}"))
        if trace.ACTIVE is not None:
            end = time.perf_counter_ns()
            trace.ACTIVE.add(name, "timer", end - int(seconds * 1e9), end)

    def as_dict(self) -> dict[str, list[float]]:
        """A copy of ``{name: [durations in recording order]}``."""
        return {k: list(v) for k, v in self._times.items()}

    def totals(self) -> dict[str, float]:
        """Total seconds per section."""
        return {k: math.fsum(v) for k, v in self._times.items()}

    def reset(self) -> None:
        """Forget every recorded duration."""
        self._times.clear()


def _is_real(value: object) -> bool:
    """A real number (numpy's included) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _duration(value: Any, where: str) -> float:
    ok = _is_real(value) and math.isfinite(value)
    if not ok or value < 0:
        raise ConfigError(f"{where}: durations must be finite non-negative seconds, got {value!r}")
    return float(value)


def _normalise(all_timing: Sequence[TimingDict], world_size: int | None) -> list[dict[str, list[float]]]:
    ranks = list(all_timing)
    if not ranks:
        raise ConfigError("all_timing is empty: pass one timing dict per rank")
    if world_size is not None and world_size != len(ranks):
        raise ConfigError(f"world_size={world_size} but all_timing holds {len(ranks)} ranks' timings")
    out = []
    for r, timing in enumerate(ranks):
        if not isinstance(timing, Mapping):
            raise ConfigError(f"rank {r}: expected a dict step -> seconds, got {type(timing).__name__}")
        out.append({str(k): _durations(v, f"rank {r} step {k!r}") for k, v in timing.items()})
    return out


def _durations(value: Any, where: str) -> list[float]:
    if isinstance(value, numbers.Real):
        return [_duration(value, where)]
    try:
        items = list(value)
    except TypeError:
        raise ConfigError(f"{where}: expected seconds or a list of seconds, got {value!r}") from None
    return [_duration(x, where) for x in items]


def _step_names(timings: list[dict[str, list[float]]]) -> list[str]:
    return list(dict.fromkeys(name for t in timings for name in t))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _score(fastest: float, own: float) -> float:
    return fastest / own if own > 0 else 1.0


@dataclass(frozen=True)
class StepTime:
    """One step across ranks.

    Per rank: ``totals`` and ``means`` (None where the step is missing; a mean is also None for an
    empty list) and ``counts``. Over ranks, Megatron-style: ``min_total`` / ``max_total`` /
    ``mean_total`` and the ranks of the extremes. ``scores[r] = min mean / own mean`` (1 = fastest,
    None without entries): means, not totals, so a rank that ran fewer iterations does not look fast.
    """

    name: str
    totals: tuple[float | None, ...]
    means: tuple[float | None, ...]
    counts: tuple[int, ...]
    min_total: float
    max_total: float
    mean_total: float
    min_rank: int
    max_rank: int
    scores: tuple[float | None, ...]
    missing_ranks: tuple[int, ...]

    @property
    def lowest_score(self) -> float | None:
        """The slowest rank's score for this step (None if no rank has entries)."""
        return min((x for x in self.scores if x is not None), default=None)


@dataclass(frozen=True)
class TimeReport:
    """Per-step timing across ranks plus per-rank figures over the steps every rank has entries for.

    ``rank_totals[r]`` sums those steps' totals; ``iteration_times[r]`` sums their means (seconds per
    iteration). ``scores[r] = min(iteration_times) / iteration_times[r]`` is the relative straggler
    score (1 = fastest rank); ranks scoring below ``threshold`` are ``stragglers``.
    """

    world_size: int
    steps: tuple[StepTime, ...]
    rank_totals: tuple[float, ...]
    iteration_times: tuple[float, ...]
    scores: tuple[float, ...]
    stragglers: tuple[int, ...]
    threshold: float

    def step(self, name: str) -> StepTime:
        """The entry of step ``name``."""
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step {name!r}; steps: {[s.name for s in self.steps]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return _jsonable(asdict(self))

    def table(self) -> Table:
        """Title, headers, rows and notes for printing."""
        def score(s: StepTime) -> str:
            return "-" if s.lowest_score is None else f"{s.lowest_score:.2f}"

        rows = [[s.name, f"{s.min_total:.4g}", f"{s.mean_total:.4g}", f"{s.max_total:.4g}", str(s.max_rank),
                 score(s), ",".join(map(str, s.missing_ranks)) or "-"] for s in self.steps]
        worst = min(range(self.world_size), key=lambda r: (self.scores[r], r))
        notes = [f"time per iteration over steps every rank has: min {min(self.iteration_times):.4g} s, "
                 f"max {max(self.iteration_times):.4g} s; "
                 f"lowest score {self.scores[worst]:.2f} (rank {worst})",
                 f"stragglers (score < {self.threshold:g}): {list(self.stragglers) or 'none'}"]
        headers = ["step", "min\ntotal s", "mean\ntotal s", "max\ntotal s", "slowest\nrank", "lowest\nscore",
                   "missing\non"]
        return f"Time per step over {self.world_size} ranks", headers, rows, notes


def _step_time(name: str, timings: list[dict[str, list[float]]]) -> StepTime:
    lists = [t.get(name) for t in timings]
    totals = tuple(None if v is None else math.fsum(v) for v in lists)
    means = tuple(None if not v else math.fsum(v) / len(v) for v in lists)
    present = {r: v for r, v in enumerate(totals) if v is not None}  # rank -> total, in rank order
    fastest = min((m for m in means if m is not None), default=0.0)
    return StepTime(
        name=name, totals=totals, means=means, counts=tuple(0 if v is None else len(v) for v in lists),
        min_total=min(present.values()), max_total=max(present.values()),
        mean_total=math.fsum(present.values()) / len(present),
        min_rank=min(present, key=lambda r: (present[r], r)),
        max_rank=max(present, key=lambda r: (present[r], -r)),
        scores=tuple(None if m is None else _score(fastest, m) for m in means),
        missing_ranks=tuple(r for r, v in enumerate(totals) if v is None))


def _fsum_present(values: Iterable[float | None]) -> float:
    """The exact sum of the values that are not None (over steps every rank has, that is all of them)."""
    return math.fsum(v for v in values if v is not None)


def time_report(all_timing: Sequence[TimingDict], world_size: int | None = None,
                threshold: float = 0.7) -> TimeReport:
    """Per-step totals, means, min / max over ranks and straggler scores (torchgfn ``report_time_info``).

    Steps missing on some ranks are kept (their ``missing_ranks`` say where) but, like steps some
    rank has no entries for, left out of the per-rank figures, so that ranks compare fairly.
    """
    if not _is_real(threshold) or not 0.0 < threshold <= 1.0:
        raise ConfigError(f"threshold must be in (0, 1], got {threshold!r}; "
                          "0.7 flags ranks taking more than 1/0.7 = 1.43 times the fastest rank's time")
    timings = _normalise(all_timing, world_size)
    steps = tuple(_step_time(name, timings) for name in _step_names(timings))
    common = [s for s in steps if all(c > 0 for c in s.counts)]
    n = len(timings)
    totals = tuple(_fsum_present(s.totals[r] for s in common) for r in range(n))
    per_iteration = tuple(_fsum_present(s.means[r] for s in common) for r in range(n))
    scores = tuple(_score(min(per_iteration), t) for t in per_iteration)
    return TimeReport(n, steps, totals, per_iteration, scores,
                      tuple(r for r, x in enumerate(scores) if x < threshold), float(threshold))


def _waiting_share(useful: float, waiting: float) -> float:
    wall = useful + waiting
    return waiting / wall if wall > 0 else 0.0


@dataclass(frozen=True)
class StepImbalance:
    """Load imbalance of one step over the ``iterations`` every rank recorded.

    Per iteration ``useful`` is the mean over ranks and ``waiting`` is ``max − mean`` (the time the
    average rank waits for the slowest at the next synchronisation). ``dropped[r]`` counts rank
    ``r``'s extra iterations that not every rank has, which are left out. ``caused[r]`` is the wait
    rank ``r`` made the others sit through, summed over the iterations it was the slowest in
    (``Σ_others (its time − theirs)``); ``slowest_rank`` caused the most (the straggler of this step).
    """

    name: str
    iterations: int
    dropped: tuple[int, ...]
    useful: tuple[float, ...]
    waiting: tuple[float, ...]
    useful_total: float
    waiting_total: float
    caused: tuple[float, ...] = ()
    slowest_rank: int | None = None

    @property
    def wait_caused(self) -> float:
        """Seconds of waiting :attr:`slowest_rank` caused the other ranks (0 without iterations)."""
        return 0.0 if self.slowest_rank is None else self.caused[self.slowest_rank]

    @property
    def waiting_fraction(self) -> float:
        """Share of the step's synchronised wall time (useful + waiting) spent waiting."""
        return _waiting_share(self.useful_total, self.waiting_total)


@dataclass(frozen=True)
class ImbalanceReport:
    """Load imbalance per step; ``skipped`` maps steps some ranks lack to those ranks."""

    world_size: int
    steps: tuple[StepImbalance, ...]
    skipped: dict[str, tuple[int, ...]]
    useful_total: float
    waiting_total: float

    @property
    def waiting_fraction(self) -> float:
        """Share of the total synchronised wall time spent waiting."""
        return _waiting_share(self.useful_total, self.waiting_total)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields, with the waiting fractions."""
        data = _jsonable(asdict(self))
        for entry, step in zip(data["steps"], self.steps):
            entry["waiting_fraction"] = step.waiting_fraction
            entry["wait_caused"] = step.wait_caused
        data["waiting_fraction"] = self.waiting_fraction
        return data

    def table(self) -> Table:
        """Title, headers, rows and notes for printing."""
        rows = [[s.name, str(s.iterations), f"{s.useful_total:.4g}", f"{s.waiting_total:.4g}",
                 f"{100 * s.waiting_fraction:.1f}", "-" if s.slowest_rank is None else str(s.slowest_rank),
                 f"{s.wait_caused:.4g}", str(sum(s.dropped))] for s in self.steps]
        notes = [f"total: useful {self.useful_total:.4g} s, waiting {self.waiting_total:.4g} s "
                 f"({100 * self.waiting_fraction:.1f}% of synchronised time)"]
        worst = max(self.steps, key=lambda s: s.wait_caused, default=None)
        if worst is not None and worst.wait_caused > 0:
            notes.append(f"straggler: rank {worst.slowest_rank} in step {worst.name!r} made the other ranks wait "
                         f"{worst.wait_caused:.4g} s in all")
        notes += [f"step {name!r} skipped: missing on ranks {list(r)}" for name, r in self.skipped.items()]
        notes += [f"step {s.name!r}: only the {s.iterations} iterations every rank has are used; dropped per "
                  f"rank {list(s.dropped)}" for s in self.steps if any(s.dropped)]
        headers = ["step", "iters", "useful\ns", "waiting\ns", "wait\n%", "slowest\nrank", "wait\ncaused s",
                   "dropped"]
        return f"Load imbalance over {self.world_size} ranks", headers, rows, notes


def _step_imbalance(name: str, lists: list[list[float]]) -> StepImbalance:
    shared = min(len(v) for v in lists)
    useful, waiting = [], []
    caused = [0.0] * len(lists)
    for i in range(shared):
        column = [v[i] for v in lists]
        mean = math.fsum(column) / len(column)
        useful.append(mean)
        waiting.append(max(max(column) - mean, 0.0))
        slowest = max(range(len(column)), key=lambda r: (column[r], -r))
        caused[slowest] += len(column) * waiting[-1]  # Σ_r (max − t_r) = n · (max − mean)
    slowest_rank = max(range(len(lists)), key=lambda r: (caused[r], -r)) if shared else None
    return StepImbalance(name, shared, tuple(len(v) - shared for v in lists), tuple(useful), tuple(waiting),
                         math.fsum(useful), math.fsum(waiting), tuple(caused), slowest_rank)


def imbalance_report(all_timing: Sequence[TimingDict], world_size: int | None = None) -> ImbalanceReport:
    """Useful and waiting time per step and in total (torchgfn ``report_load_imbalance``).

    Steps that some ranks lack are skipped and listed in ``skipped``; ranks with more iterations
    than others contribute only the iterations every rank has.
    """
    timings = _normalise(all_timing, world_size)
    steps, skipped = [], {}
    for name in _step_names(timings):
        missing = tuple(r for r, t in enumerate(timings) if name not in t)
        if missing:
            skipped[name] = missing
        else:
            steps.append(_step_imbalance(name, [t[name] for t in timings]))
    return ImbalanceReport(len(timings), tuple(steps), skipped, math.fsum(s.useful_total for s in steps),
                           math.fsum(s.waiting_total for s in steps))


def format_report(report: TimeReport | ImbalanceReport) -> str:
    """The report as a plain-text table followed by its notes."""
    title, headers, rows, notes = report.table()
    headers = [h.replace("\n", " ") for h in headers]  # two-line headers of the rich table, on one line
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    body = [line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows]
    return "\n".join([title, *body, *notes]) + "\n"


def print_report(report: TimeReport | ImbalanceReport, file: TextIO | None = None,
                 use_rich: bool | None = None) -> None:
    """Print ``report`` to ``file`` (default stdout); a rich table when rich is installed (or asked for)."""
    if use_rich is None:
        use_rich = importlib.util.find_spec("rich") is not None
    if not use_rich:
        (file or sys.stdout).write(format_report(report))
        return
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError as e:
        raise ImportError("print_report(use_rich=True) needs rich: pip install 'popmesh[demo]'") from e
    from rich import box

    title, headers, rows, notes = report.table()
    # Narrow enough for an 80-column terminal with the launcher's "[rank 0] " before each line: two-line
    # headers, rules only under the header, and cells that never wrap or cut.
    table = RichTable(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, show_edge=False,
                       pad_edge=False)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console(file=file or sys.stdout)
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)


def save_chart(report: TimeReport, path: str | Path) -> Path:
    """Save a PNG of stacked per-rank time per step (one bar per rank) and return its path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("save_chart needs matplotlib: pip install 'popmesh[demo]'") from e
    fig = Figure(figsize=(max(4.0, 0.5 * report.world_size + 2), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ranks = list(range(report.world_size))
    bottom = [0.0] * report.world_size
    for step in report.steps:
        heights = [t or 0.0 for t in step.totals]
        ax.bar(ranks, heights, bottom=bottom, label=step.name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("rank")
    ax.set_ylabel("time (s)")
    ax.set_xticks(ranks)
    ax.set_title(f"Time per step per rank (stragglers: {list(report.stragglers) or 'none'})")
    if report.steps:
        ax.legend(fontsize="small")
    out = Path(path)
    fig.savefig(out, format="png")
    return out
