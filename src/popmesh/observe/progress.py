"""Progress of a user's loop on every rank, drawn by rank 0: ``popmesh.Progress``.

Every rank calls :meth:`Progress.update` with its step and a few numbers; at most every
``send_every_s`` seconds that becomes one small non-blocking message to rank 0 on a reserved tag, so
no rank ever waits for another. Rank 0 takes in what has arrived whenever it updates, and draws a
live table with rich on a terminal, or prints one plain line every ``print_every_s`` seconds
elsewhere (sbatch logs, nohup, CI). Reports are best effort: a rank that cannot reach rank 0 any more
(it finished, or was lost) stops reporting and trains on.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from popmesh.comm import messages
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, PopmeshError

__all__ = ["Progress", "PROGRESS_TAG"]

PROGRESS_TAG = messages.internal_tag(messages.OBSERVE_TAGS.start - messages.INTERNAL_TAG_BASE)


class Progress:
    """Every rank reports ``update(step, **numbers)``; rank 0 shows all ranks (see the module docstring).

    ``total``: the step count a rank ends at (for the percentage; None: unknown). ``live``: draw
    with rich (default: when stdout is a terminal). Close it on every rank (or use it as a context
    manager): rank 0 then waits up to ``final_wait_s`` for the others' last reports and shows them.
    """

    def __init__(self, total: int | None = None, *, title: str = "progress", group: Comm | None = None,
                 live: bool | None = None, send_every_s: float = 0.5, print_every_s: float = 5.0,
                 final_wait_s: float = 5.0) -> None:
        if total is not None and total < 1:
            raise ConfigError(f"Progress(total={total}): give a positive step count, or None")
        comm = resolve_group(group)
        self.world, self.total, self.title = comm.world, total, title
        self.rank, self.size = comm.world.rank, comm.world.size
        self.send_every_s, self.print_every_s, self.final_wait_s = send_every_s, print_every_s, final_wait_s
        self.rows: dict[int, dict[str, Any]] = {}  # rank 0: each rank's latest report
        self._finished: set[int] = set()
        self._sent_at = self._printed_at = -math.inf
        self._sends: list[messages.SendHandle] = []
        self._reporting = True
        self._live: Any = None
        self._inbox = messages.irecv(None, PROGRESS_TAG) if self.rank == 0 and self.size > 1 else None
        if self.rank == 0 and (sys.stdout.isatty() if live is None else live):
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=4, transient=False)
            self._live.start()

    def update(self, step: int, **values: float) -> None:
        """This rank is at ``step`` with ``values`` (numbers); never blocks on other ranks."""
        row = {"step": int(step), **{k: float(v) for k, v in values.items()}, "time": time.time()}
        self.rows[self.rank] = row  # elsewhere than rank 0 only this rank's own, sent again at close
        if self.rank == 0:
            self._take_in()
            self._show()
        elif time.monotonic() - self._sent_at >= self.send_every_s:
            self._send(row)

    def close(self) -> None:
        """Every rank: send (or, on rank 0, wait up to ``final_wait_s`` for) the last reports; idempotent."""
        if self.rank != 0:
            if self._reporting:
                self._send({**self.rows.get(self.rank, {}), "done": True})
                for handle in self._sends:
                    try:
                        handle.wait(self.final_wait_s)
                    except PopmeshError:
                        break
            self._reporting = False
            return
        deadline = time.monotonic() + self.final_wait_s
        while self._inbox is not None and len(self._finished) < self.size - 1 and time.monotonic() < deadline:
            self._take_in()
            time.sleep(0.01)
        self._inbox = None
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None
        elif self.rows:
            print(self.line(), flush=True)

    def line(self) -> str:
        """Rank 0's plain progress line: each rank's step and numbers."""
        parts = []
        for rank in range(self.size):
            row = self.rows.get(rank)
            if row is None:
                parts.append(f"r{rank} —")
                continue
            numbers = " ".join(f"{k} {v:.4g}" for k, v in row.items() if k not in ("step", "time", "done"))
            parts.append(f"r{rank} {self._step(row)}{' ' + numbers if numbers else ''}")
        return f"[{self.title}] " + "  |  ".join(parts)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, row: Mapping[str, Any]) -> None:
        if not self._reporting:
            return
        self._sent_at = time.monotonic()
        try:
            self._sends = [h for h in self._sends if not h.done()]
            self._sends.append(messages.isend(dict(row), 0, PROGRESS_TAG))
        except PopmeshError:  # rank 0 is gone (finished or lost): progress is best effort
            self._reporting = False

    def _take_in(self) -> None:
        """Rank 0: every report that has arrived, without blocking."""
        self._inbox, arrived = messages.take_arrived(self._inbox, PROGRESS_TAG)  # None: every other rank is gone
        for src, row in arrived:
            if row.get("done"):
                self._finished.add(src)
            if "step" in row:
                self.rows[src] = row

    def _show(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
        elif time.monotonic() - self._printed_at >= self.print_every_s:
            self._printed_at = time.monotonic()
            print(self.line(), flush=True)

    def _step(self, row: Mapping[str, Any]) -> str:
        if self.total is None:
            return f"step {row['step']:,}"
        return f"step {row['step']:,}/{self.total:,} ({100 * row['step'] / self.total:.0f}%)"

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title=self.title, box=None, padding=(0, 2))
        keys = sorted({k for row in self.rows.values() for k in row} - {"step", "time", "done"})
        for column in ("rank", "step", *keys):
            table.add_column(column, justify="right")
        for rank in range(self.size):
            row = self.rows.get(rank)
            if row is None:
                table.add_row(str(rank), "—", *("" for _ in keys))
            else:
                table.add_row(str(rank), self._step(row), *(f"{row[k]:.4g}" if k in row else "" for k in keys))
        return table
