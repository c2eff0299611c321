"""Hosts of an MPI world started by one mpiexec: ``--hosts a:2,b:2`` and ``--hostfile FILE``. Pure.

A host is a name (or address) and a number of ranks on it. ``--hosts`` takes mpiexec's (Hydra's) own
form, ``a:2,b:2``; a host given without a count gets ``-n`` ranks. A host file has one host a line in
Hydra's form (``a:2``) or Open MPI's (``a slots=2``), with ``#`` comments; the same host named twice
adds up. The world's ranks are placed in that order: ``a:2,b:2`` puts ranks 0 and 1 on ``a``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from popmesh.core.errors import ConfigError

__all__ = ["Slots", "parse_hosts", "parse_hostfile", "read_hostfile", "hydra_hosts", "ranks_on"]

Slots = tuple[tuple[str, int], ...]
_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")  # names, IPv4, bracketed IPv6 ([::1]:2)


def parse_hosts(text: str, per_host: int) -> Slots:
    """``a:2,b:2`` (or ``a,b``, each then with ``per_host`` ranks) as ((host, ranks), ...)."""
    entries = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(entries):
        raise ConfigError(f"--hosts {text!r}: give hosts separated by commas, each with its ranks, e.g. a:2,b:2")
    return _merge(_entry(part, per_host, f"--hosts {text!r}") for part in entries)


def parse_hostfile(lines: Iterable[str], per_host: int, where: str = "the host file") -> Slots:
    """The hosts of a host file: ``host:N`` or ``host slots=N`` (or a bare host: ``per_host``) a line."""
    found = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) == 2 and fields[1].startswith("slots="):
            found.append(_entry(f"{fields[0]}:{fields[1][len('slots='):]}", per_host, f"{where}, line {number}"))
        elif len(fields) == 1:
            found.append(_entry(fields[0], per_host, f"{where}, line {number}"))
        else:
            raise ConfigError(f"{where}, line {number}: {raw.strip()!r} is not 'host:N' or 'host slots=N'")
    if not found:
        raise ConfigError(f"{where} names no host: write one a line, as host:N or host slots=N")
    return _merge(found)


def read_hostfile(path: str, per_host: int) -> Slots:
    """:func:`parse_hostfile` over the file at ``path``."""
    try:
        with open(path) as f:
            return parse_hostfile(f.readlines(), per_host, f"--hostfile {path}")
    except OSError as e:
        raise ConfigError(f"--hostfile {path}: cannot read it ({e.strerror})") from e


def hydra_hosts(slots: Slots) -> str:
    """mpiexec's ``-hosts`` value for ``slots``."""
    return ",".join(f"{host}:{n}" for host, n in slots)


def ranks_on(slots: Slots) -> int:
    """The world size: the ranks on all hosts."""
    return sum(n for _, n in slots)


def _entry(part: str, per_host: int, where: str) -> tuple[str, int]:
    host, count = part, None
    bracketed = part.startswith("[")
    if (bracketed and "]:" in part) or (not bracketed and part.count(":") == 1):
        host, _, count = part.rpartition(":")
    host = host.strip("[]") if bracketed else host
    if not host or not _HOST.match(host):
        raise ConfigError(f"{where}: {part!r} is not a host name or address")
    if count is None:
        return host, per_host
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"{where}: {part!r} needs a whole number of ranks (1 or more) after the colon")
    return host, int(count)


def _merge(entries: Iterable[tuple[str, int]]) -> Slots:
    totals: dict[str, int] = {}
    for host, n in entries:
        totals[host] = totals.get(host, 0) + n
    return tuple(totals.items())
