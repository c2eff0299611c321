"""Cross-rank agreement: do all ranks call the same collective with the same shapes and dtypes?

Two cheap rounds: every rank shares a 64-bit digest of its description; only if digests differ do
ranks exchange the full descriptions, so that *every* rank raises :class:`CollectiveMismatch` listing
each rank's values (Accelerate's debug mode, torch's DETAIL checks).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from popmesh.core.arrays import dtype_name, leaf_shape
from popmesh.core.dtypes import DTYPES
from popmesh.core.errors import CollectiveMismatch

__all__ = ["exchange_texts", "describe_leaves", "agree", "exchange_shapes", "exchange_all_shapes"]


def describe_leaves(leaves: Sequence[Any]) -> str:
    """``float32[3,4] int64[]`` — a readable signature of the leaves."""
    return " ".join(f"{dtype_name(x)}[{','.join(map(str, leaf_shape(x)))}]" for x in leaves)


def _digest(text: str) -> int:
    raw = text.encode()
    return (zlib.crc32(raw) << 32) | zlib.adler32(raw)


def agree(comm: Any, description: str, what: str, timeout: float) -> None:
    """Raise CollectiveMismatch on every rank of ``comm`` unless all ranks passed the same text."""
    engine = comm.world.engine
    mine = np.array([_digest(description) & 0x7FFF_FFFF_FFFF_FFFF, len(description.encode())], dtype=np.int64)
    table = engine.all_gather(mine, comm.handle, timeout)
    if (table[:, 0] == table[0, 0]).all():
        return
    texts = exchange_texts(comm, description, int(table[:, 1].max()), timeout)
    listing = "; ".join(f"rank {r}: {t}" for r, t in zip(comm.ranks, texts))
    raise CollectiveMismatch(
        f"{what}: ranks disagree on the call ({listing}). Every rank of the group must call the same "
        "collective with the same structure, shapes and dtypes.",
        dict(zip(comm.ranks, texts)),
    )


def exchange_texts(comm: Any, text: str, width: int, timeout: float) -> list[str]:
    """Every member's ``text`` (UTF-8, cut to ``width`` bytes), gathered straight through the engine."""
    raw = text.encode()[:width]
    padded = np.zeros(width, dtype=np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    rows = comm.world.engine.all_gather(padded, comm.handle, timeout)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


_BY_CODE = {zlib.crc32(d.name.encode()): d.name for d in DTYPES}


def exchange_shapes(
    comm: Any, leaf: Any, what: str, timeout: float, *, same_leading: bool
) -> list[tuple[int, ...]]:
    """Every rank's shape of ``leaf`` (see :func:`exchange_all_shapes`)."""
    return exchange_all_shapes(comm, [leaf], what, timeout, same_leading=same_leading)[0]


def exchange_all_shapes(
    comm: Any, leaves: Sequence[Any], what: str, timeout: float, *, same_leading: bool
) -> list[list[tuple[int, ...]]]:
    """For each leaf, every rank's shape, in one small collective for all leaves. Raise
    CollectiveMismatch on every rank if dtypes, numbers of dimensions or trailing dimensions differ
    (or leading ones, when ``same_leading``)."""
    rows = np.full((len(leaves), 10), -1, dtype=np.int64)
    for row, leaf in zip(rows, leaves):
        shape = leaf_shape(leaf)
        if len(shape) > 8:
            raise ValueError(f"{what}: arrays of more than 8 dimensions are not supported (got {len(shape)})")
        row[0] = zlib.crc32(dtype_name(leaf).encode())
        row[1] = len(shape)
        row[2 : 2 + len(shape)] = shape
    tables = comm.world.engine.all_gather(rows, comm.handle, timeout)  # [rank, leaf, 10]
    first = 2 if same_leading else 3
    out = []
    for i in range(len(leaves)):
        table = tables[:, i]
        if not ((table[:, :2] == table[0, :2]).all() and (table[:, first:] == table[0, first:]).all()):
            per_rank = {r: _row_text(t) for r, t in zip(comm.ranks, table)}
            listing = "; ".join(f"rank {r}: {t}" for r, t in per_rank.items())
            need = "the same shape" if same_leading else "the same dtype and trailing dimensions"
            raise CollectiveMismatch(f"{what}: every rank must pass {need} ({listing})", per_rank)
        out.append([tuple(int(d) for d in r[2 : 2 + int(r[1])]) for r in table])
    return out


def _row_text(row: np.ndarray) -> str:
    dims = ",".join(str(int(d)) for d in row[2 : 2 + int(row[1])])
    return f"{_BY_CODE.get(int(row[0]), 'unknown dtype')}[{dims}]"
