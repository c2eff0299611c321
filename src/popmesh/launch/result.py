"""What a launch ended with: the result, the root-cause failure and its printed summary."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from popmesh.core.errors import PeerFailure
from popmesh.launch.errorfile import ErrorRecord

__all__ = ["RankFailure", "LaunchResult", "LaunchFailed", "exit_status", "format_summary"]


def exit_status(returncode: int) -> tuple[int, str | None]:
    """Shell-style status of a ``Popen.returncode``: (128+N, "SIGxxx") for a signal, else (code, None)."""
    if returncode >= 0:
        return returncode, None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return 128 - returncode, name


@dataclass(frozen=True)
class RankFailure:
    """One rank that ended badly. ``rank`` is None when mpiexec failed and no rank left a record."""

    rank: int | None
    exitcode: int
    signal: str | None = None
    error: ErrorRecord | None = None
    stderr_tail: tuple[str, ...] = ()
    host: str = ""  # where the rank ran, when known

    def describe(self) -> str:
        """One line: who failed and how, and on which host."""
        who = "mpiexec" if self.rank is None else f"rank {self.rank}"
        if self.signal:
            how = f"was killed by {self.signal} (exit code {self.exitcode})"
        else:
            how = f"exited with code {self.exitcode}"
        if self.error is not None:
            how += f" after raising {self.error.type}: {self.error.message}"
        return f"{who} {how}" + (f", on host {self.host}" if self.host else "")


@dataclass(frozen=True)
class LaunchResult:
    """The end of a launch: exit code, the first failed rank (root cause) and what was torn down."""

    returncode: int
    world_size: int
    engine: str
    failure: RankFailure | None = None
    other_failures: tuple[RankFailure, ...] = ()
    terminated: tuple[int, ...] = ()
    interrupted_by: str | None = None
    hints: tuple[str, ...] = field(default=())
    restarts: tuple[str, ...] = ()  # one line per rank restarted during the run (--max-restarts)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> LaunchResult:
        """Return self if every rank succeeded, else raise :class:`LaunchFailed`."""
        if not self.ok:
            raise LaunchFailed(self)
        return self


class LaunchFailed(PeerFailure):
    """A launched world failed; ``result`` holds the root cause, ``ranks`` the ranks that failed.

    The message is one line; the full summary (with the traceback) is ``format_summary(result)``,
    which the launcher has already printed.
    """

    def __init__(self, result: LaunchResult) -> None:
        failures = [f for f in (result.failure, *result.other_failures) if f is not None]
        cause = result.failure.describe() if result.failure else f"interrupted by {result.interrupted_by}"
        message = f"launched world failed with exit code {result.returncode}: {cause}"
        super().__init__(message, tuple(f.rank for f in failures if f.rank is not None))
        self.result = result


def _indent(lines: list[str], pad: str = "    ") -> list[str]:
    return [pad + line for line in lines]


def format_summary(result: LaunchResult) -> str:
    """The root-cause report printed by the launcher when a launch did not succeed."""
    lines = [
        f"popmesh launch: FAILED (exit code {result.returncode}, {result.engine} engine, "
        f"world size {result.world_size})"
    ]
    if result.interrupted_by:
        lines.append(f"  the launcher received {result.interrupted_by} and tore the world down")
    failure = result.failure
    if failure is not None:
        lines.append(f"  root cause: {failure.describe()}")
        if failure.error is not None:
            lines.append("  traceback:")
            lines += _indent(failure.error.traceback.rstrip("\n").splitlines())
        elif failure.stderr_tail:
            lines.append("  last lines of its stderr:")
            lines += _indent(list(failure.stderr_tail))
        else:
            lines.append("  it left no error record and wrote nothing to stderr")
    for other in result.other_failures:
        lines.append(f"  also failed: {other.describe()}")
    lines += [f"  earlier: {note}" for note in result.restarts]
    if result.terminated:
        lines.append(f"  terminated by the launcher: ranks {', '.join(map(str, result.terminated))}")
    lines += [f"  hint: {hint}" for hint in result.hints]
    return "\n".join(lines)
