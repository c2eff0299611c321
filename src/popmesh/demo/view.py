"""Rank 0's view of the population: a live table (rich) on a terminal; elsewhere (sbatch logs, nohup, CI)
a plain progress line every few seconds and a line per event, so a log shows the run as it goes."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from popmesh.demo.membership import steps_goal

__all__ = ["RankStatus", "PopulationView", "describe_event", "describe_explore"]


@dataclass
class RankStatus:
    steps: int = 0
    mean_return: float = float("nan")
    steps_per_s: float = 0.0
    replaced: int = 0
    lr: float = math.nan
    ent_coef: float = math.nan
    left: bool = False  # gone for good from an elastic world


@dataclass
class PopulationView:
    """Holds what rank 0 knows and renders it: ``live`` draws the table; ``plain`` (stdout is not a
    terminal) prints a progress line every ``plain_every_s`` seconds and each event as it comes;
    neither prints nothing until the summary. Rows are keyed by agent (the launcher's number for its rank,
    ``agents``; default ``0..ranks-1``): an elastic world adds rows for agents that join and keeps those
    that left, marked so."""

    ranks: int
    total_steps: int
    policy: str
    env: str = "CartPole-v1"
    live: bool = True
    plain: bool = False
    plain_every_s: float = 5.0
    agents: tuple[int, ...] = ()
    status: dict[int, RankStatus] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    _live: Any = None
    _started: float = field(default_factory=time.monotonic)
    _printed: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.status = {int(a): RankStatus() for a in (self.agents or range(self.ranks))}

    def start(self) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.live import Live

        # force: under mpiexec rank 0's stdout is a pipe that ends on the user's terminal
        self._live = Live(self.render(), refresh_per_second=4, transient=False, console=Console(force_terminal=True))
        self._live.start()

    def update(self, rank: int, **values: Any) -> None:
        """Agent ``rank``'s latest numbers (a row for an agent not seen before)."""
        status = self.status.setdefault(rank, RankStatus())
        for key, value in values.items():
            setattr(status, key, value)
        self._refresh()

    def replaced(self, rank: int) -> None:
        """Agent ``rank`` was replaced by the population policy."""
        self.status.setdefault(rank, RankStatus()).replaced += 1

    def join(self, rank: int) -> None:
        """Agent ``rank`` joined the population (a later launcher's rank): a row of its own."""
        self.status.setdefault(rank, RankStatus()).left = False
        self._refresh()

    def leave(self, rank: int) -> None:
        """Agent ``rank`` left for good: its row stays, marked left, at the steps it had."""
        self.status.setdefault(rank, RankStatus()).left = True
        self._refresh()

    @property
    def present(self) -> int:
        """The agents training now (those that have not left)."""
        return sum(not s.left for s in self.status.values())

    def goal(self) -> int:
        """The env steps the population will have taken at the end (an agent that left: those it had)."""
        return steps_goal(self.total_steps, {r: s.steps for r, s in self.status.items()},
                          [r for r, s in self.status.items() if s.left])

    def add_event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._started:6.1f}s  {text}")
        if self.plain:
            print(f"[popmesh demo] {self.events[-1].strip()}", flush=True)
        self._refresh()

    def progress_line(self) -> str:
        """One line for a log: elapsed time, env steps done, and each rank's return, learning rate and
        entropy coefficient."""
        done = sum(s.steps for s in self.status.values())
        ranks = "  ".join(f"r{rank} {'—' if math.isnan(s.mean_return) else f'{s.mean_return:.0f}'} "
                          f"(lr {_value(s.lr)}, ent {_value(s.ent_coef)}{', left' if s.left else ''})"
                          for rank, s in self.status.items())
        return (f"[popmesh demo] {time.monotonic() - self._started:6.1f}s  {done:,}/{self.goal():,} "
                f"env steps  return (last 20): {ranks}")

    def stop(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
        elif self.plain and time.monotonic() - self._printed >= self.plain_every_s:
            self._printed = time.monotonic()
            print(self.progress_line(), flush=True)

    def render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        done = sum(s.steps for s in self.status.values())
        goal = self.goal()
        header = Text(f"population of {self.present} {self.env} agents · policy {self.policy} · "
                      f"{done:,}/{goal:,} env steps · {time.monotonic() - self._started:5.1f}s")
        table = Table(expand=False, box=None, padding=(0, 1))
        for column in ("rank", "lr", "ent_coef", "steps", "return (last 20)", "steps/s", "replaced"):
            table.add_column(column, justify="right")
        for rank, s in self.status.items():
            ret = "—" if math.isnan(s.mean_return) else f"{s.mean_return:6.1f}"
            name = f"{rank} (left)" if s.left else str(rank)
            table.add_row(name, _value(s.lr), _value(s.ent_coef), f"{s.steps:,}", ret, f"{s.steps_per_s:,.0f}",
                          str(s.replaced))
        recent = "\n".join(self.events[-6:]) or "no replacements yet"
        return Group(header, ProgressBar(total=goal, completed=min(done, goal), width=60), table,
                     Panel(recent, title="replacement events", expand=False))


def _value(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.1e}"


def describe_event(replaced: int, donors: list[int], weights: list[float], strategy: str) -> str:
    """``rank 3 ← mean(rank 0, rank 1)`` or a weighted form."""
    names = ", ".join(f"rank {d}" for d in donors)
    if not donors:
        return f"rank {replaced} ← re-initialised"
    if len(donors) == 1:
        return f"rank {replaced} ← copy(rank {donors[0]})"
    if strategy == "mean" or len(set(round(w, 6) for w in weights)) <= 1:
        return f"rank {replaced} ← mean({names})"
    parts = ", ".join(f"{w:.2f}·rank {d}" for d, w in zip(donors, weights))
    return f"rank {replaced} ← {strategy}({parts})"


def describe_explore(event: dict[str, Any]) -> str:
    """``, lr 1.2e-03 → 1.4e-03, ent_coef 1.0e-02 → 8.0e-03 (explored)`` for the values the explore step
    changed on a replaced agent; empty when it changed none."""
    moved = [f"{name} {event[f'{name}_inherited']:.1e} → {event[name]:.1e}" for name in event.get("explored", ())
             if f"{name}_inherited" in event and name in event]
    return f", {', '.join(moved)} (explored)" if moved else ""
