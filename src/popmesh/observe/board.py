"""TensorBoard scalars from every rank of a run: one TensorBoard run per rank, or rank 0's only.

Each rank writes its own event files under ``logdir/rank-R`` (R: its launcher number, ``world.roster``, which
is its rank in a world of fixed size and stays when an elastic world renumbers its ranks) with torch's
maintained writer
(``torch.utils.tensorboard``), so ``tensorboard --logdir runs`` shows every agent's curve side by
side and nothing crosses the network: no rank waits for another to log. With ``ranks="main"`` only
rank 0 writes (for values that are the same everywhere, such as an averaged loss), under
``logdir/main``; the others' calls do nothing.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError

__all__ = ["Board"]


class Board:
    """Rank-aware TensorBoard logging (see the module docstring); close it, or use it as a context manager.

    ``scalar(name, value, step)`` logs one number; ``scalars({...}, step)`` several at one step;
    ``text(name, value, step)`` a line of text (replacement events, donors). A value of None is
    skipped; NaN and infinities are logged as they are (TensorBoard shows them), so a broken run is
    visible rather than hidden. ``step`` is the x axis: env steps or iterations, the same on every rank.
    """

    def __init__(self, logdir: str | Path, *, ranks: Literal["all", "main"] = "all", group: Comm | None = None,
                 flush_secs: float = 10.0) -> None:
        if ranks not in ("all", "main"):
            raise ConfigError(f"Board(ranks={ranks!r}): use 'all' (one run per rank) or 'main' (rank 0 only)")
        comm = resolve_group(group)
        self.rank = comm.world.rank
        self.active = ranks == "all" or self.rank == 0
        name = comm.world.roster[self.rank]  # an elastic world renumbers ranks; a launcher number stays
        self.path = Path(logdir) / (f"rank-{name}" if ranks == "all" else "main")
        self._writer: Any = None
        if self.active:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("TensorBoard logging needs the tensorboard package: pip install 'popmesh[demo]' "
                                  f"(or pip install tensorboard); {e}") from e
            self._writer = SummaryWriter(str(self.path), flush_secs=max(1, round(flush_secs)))

    def scalar(self, name: str, value: Any, step: int) -> None:
        """Log ``value`` (a real number) under ``name`` at ``step`` (None: nothing)."""
        if self._writer is None or value is None:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"Board.scalar({name!r}): need a real number, got {type(value).__name__} {value!r}")
        self._writer.add_scalar(name, float(value), int(step))

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """Log every entry of ``values`` at ``step`` (None values are skipped)."""
        for name, value in values.items():
            self.scalar(name, value, step)

    def text(self, name: str, value: str, step: int) -> None:
        """Log a line of text under ``name`` at ``step`` (TensorBoard's Text tab)."""
        if self._writer is not None:
            self._writer.add_text(name, value, int(step))

    def flush(self) -> None:
        """Write what is buffered to disk now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

