"""Per-rank log files as torchrun writes them: ``--log-dir``, ``--tee``, ``--redirects``, ``--local-ranks-filter``.

torchrun's values: ``0`` nothing, ``1`` stdout, ``2`` stderr, ``3`` both, for every local rank, or
per local rank ``LOCAL_RANK:VALUE,...`` (ranks not named get 0). ``--redirects`` sends a stream to its
file only, ``--tee`` to its file and the console. Files go where torchrun's ``DefaultLogsSpecs`` puts
them, so tools that read torchrun's log directories read ours::

    <log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/stdout.log, stderr.log, error.json

One deliberate difference: ``--log-dir`` without ``--tee`` or ``--redirects`` tees both streams (a
log directory with no logs in it is never what was meant); torchrun writes only ``error.json`` there.
``error.json`` is the rank's error record (``POPMESH_ERROR_FILE``), copied in when the rank failed.

Planning (:func:`log_request`, :func:`plan_routes`) is pure; :class:`RankLogs` owns the open files
and is what the output pump writes each line through.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from popmesh.core.errors import ConfigError
from popmesh.launch.plan import error_file_name

__all__ = [
    "STREAM_BITS",
    "StdSetting",
    "parse_std",
    "std_bits",
    "LogRequest",
    "log_request",
    "RankRoute",
    "plan_routes",
    "make_attempt_dir",
    "RankLogs",
]

STREAM_BITS = {"stdout": 1, "stderr": 2}
StdSetting = int | Mapping[int, int]
_VALUE = re.compile(r"^[0-3]$")
_PER_RANK = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


def parse_std(value: int | str | Mapping[int, int] | None, option: str) -> StdSetting:
    """torchrun's ``--tee``/``--redirects`` value: ``0``-``3`` for all local ranks, or ``0:1,1:2`` per rank.

    ``None`` is 0. Raises :class:`ConfigError` naming ``option`` for anything else.
    """
    if value is None:
        return 0
    setting: StdSetting
    text = str(value).replace(" ", "")
    if isinstance(value, Mapping):
        setting = {int(rank): int(bits) for rank, bits in value.items()}
    elif isinstance(value, int) and not isinstance(value, bool):
        setting = value
    elif _VALUE.match(text):
        setting = int(text)
    elif _PER_RANK.match(text):
        setting = {int(rank): int(bits) for rank, bits in (item.split(":") for item in text.split(","))}
    else:
        raise _bad_std(option, value)
    pairs = {0: setting} if isinstance(setting, int) else setting
    if any(rank < 0 or not 0 <= bits <= 3 for rank, bits in pairs.items()):
        raise _bad_std(option, value)
    return setting


def _bad_std(option: str, value: object) -> ConfigError:
    return ConfigError(
        f"{option} {value!r} is not one of torchrun's values: 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
        f"or per local rank like 0:3,1:2 (local ranks not named get 0)"
    )


def std_bits(setting: StdSetting, local_rank: int) -> int:
    """The streams (bits of :data:`STREAM_BITS`) ``setting`` names for ``local_rank``."""
    return setting if isinstance(setting, int) else setting.get(local_rank, 0)


@dataclass(frozen=True)
class LogRequest:
    """What the caller asked for; ``tee``/``redirects`` already parsed, ``None`` filter shows every rank."""

    log_dir: str | None = None
    tee: StdSetting = 0
    redirects: StdSetting = 0
    local_ranks_filter: frozenset[int] | None = None

    @property
    def writes_files(self) -> bool:
        """True when a log directory is made: ``log_dir`` given, or a stream teed or redirected."""
        return self.log_dir is not None or bool(self.tee) or bool(self.redirects)

    @property
    def routes_output(self) -> bool:
        """True when any rank's output goes anywhere but the console, or some rank is hidden."""
        return self.writes_files or self.local_ranks_filter is not None


def log_request(
    log_dir: str | None = None,
    tee: int | str | Mapping[int, int] | None = None,
    redirects: int | str | Mapping[int, int] | None = None,
    local_ranks_filter: Collection[int] | None = None,
) -> LogRequest:
    """Check the log settings; ``log_dir`` with neither ``tee`` nor ``redirects`` tees both streams."""
    if log_dir is not None and not str(log_dir).strip():
        raise ConfigError("--log-dir is empty; give a directory (it is created if missing)")
    if log_dir is not None and tee is None and redirects is None:
        tee = 3
    ranks = None if local_ranks_filter is None else frozenset(local_ranks_filter)
    if ranks is not None and (not ranks or min(ranks) < 0):
        raise ConfigError(
            f"--local-ranks-filter {sorted(ranks)} must name at least one local rank >= 0, like 0,1"
        )
    return LogRequest(
        log_dir=None if log_dir is None else os.fspath(log_dir),
        tee=parse_std(tee, "--tee"),
        redirects=parse_std(redirects, "--redirects"),
        local_ranks_filter=ranks,
    )


@dataclass(frozen=True)
class RankRoute:
    """Where one rank's output goes: ``files`` (stream → path), ``console`` (streams shown), its log folder."""

    directory: str | None
    files: Mapping[str, str]
    console: frozenset[str]


def plan_routes(
    request: LogRequest, attempt_dir: str | None, ranks: Sequence[tuple[int, int]]
) -> dict[int, RankRoute]:
    """The route of each ``(rank, local_rank)``, keyed by global rank (torchrun's rules, pure).

    A teed stream is written to its file and shown; a redirected one only written; a rank outside
    ``local_ranks_filter`` is not shown at all (its files are still written).
    """
    routes = {}
    for rank, local_rank in ranks:
        tee, redirect = std_bits(request.tee, local_rank), std_bits(request.redirects, local_rank)
        directory = None if attempt_dir is None else os.path.join(attempt_dir, str(local_rank))
        files = {} if directory is None else {
            stream: os.path.join(directory, f"{stream}.log")
            for stream, bit in STREAM_BITS.items() if (tee | redirect) & bit
        }
        shown = request.local_ranks_filter is None or local_rank in request.local_ranks_filter
        console = frozenset(
            stream for stream, bit in STREAM_BITS.items() if shown and (tee & bit or not redirect & bit)
        )
        routes[rank] = RankRoute(directory, files, console)
    return routes


def make_attempt_dir(log_dir: str | None, run_id: str, restart: int = 0) -> str:
    """Create ``<log_dir>/<run_id>_<random>/attempt_<restart>`` (a temporary ``log_dir`` if None)."""
    try:
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="popmesh-logs-")
        if os.path.isfile(log_dir):
            raise ConfigError(f"--log-dir {log_dir} is a file; give a directory (it is created if missing)")
        os.makedirs(log_dir, exist_ok=True)
        run_dir = tempfile.mkdtemp(prefix=f"{run_id.replace(os.sep, '_')}_", dir=log_dir)
        attempt = os.path.join(run_dir, f"attempt_{restart}")
        os.makedirs(attempt)
    except OSError as e:
        raise ConfigError(f"cannot create the log directory in {log_dir} ({e.strerror}); choose a writable "
                          f"--log-dir") from e
    return attempt


class RankLogs:
    """The open log files of one launch; the output pump writes every rank's lines through it."""

    def __init__(self, routes: Mapping[int, RankRoute]) -> None:
        self.routes = dict(routes)
        self.folder: str | None = None  # the attempt's folder, where the launcher's own records go too
        self._lock = threading.Lock()
        self._files: dict[tuple[int, str], IO[bytes]] = {}
        try:
            for rank, route in self.routes.items():
                if route.directory is not None:
                    os.makedirs(route.directory, exist_ok=True)
                for stream, path in route.files.items():
                    self._files[(rank, stream)] = open(path, "wb", buffering=0)  # noqa: SIM115 (closed in close())
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot create a rank's log file ({e}); choose a writable --log-dir") from e

    def shows(self, rank: int, stream: str) -> bool:
        """Whether ``rank``'s ``stream`` appears on the launcher's console."""
        route = self.routes.get(rank)
        return route is None or stream in route.console

    def write(self, rank: int, stream: str, data: bytes) -> None:
        """Append ``data`` (one line as the rank wrote it) to the rank's file for ``stream``, if it has one."""
        with self._lock:
            file = self._files.get((rank, stream))
            if file is not None:
                try:
                    file.write(data)
                except (OSError, ValueError):  # disk full, or closed during teardown: keep the run going
                    self._files.pop((rank, stream), None)

    def keep_errors(self, error_dir: str) -> None:
        """Copy each rank's error record from ``error_dir`` to its log folder as ``error.json``."""
        for rank, route in self.routes.items():
            source = os.path.join(error_dir, error_file_name(rank))
            if route.directory is not None and os.path.exists(source):
                try:
                    shutil.copyfile(source, os.path.join(route.directory, "error.json"))
                except OSError:
                    pass  # the launcher's own summary still names the error

    def close(self) -> None:
        """Close every file (lines that arrive later are dropped)."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for file in files:
            file.close()
