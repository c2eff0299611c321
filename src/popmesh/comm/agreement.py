"""Cross-rank agreement: do all ranks call the same collective with the same shapes, dtypes and devices?

Two cheap rounds: every rank shares a 64-bit digest of its description; only if digests differ do
ranks exchange the full descriptions, so that *every* rank raises :class:`CollectiveMismatch` listing
each rank's values (Accelerate's debug mode, torch's DETAIL checks).

A leaf's device enters a description as its type (``float32[3,4]@cuda``): ``cuda:0`` on one rank
and ``cuda:1`` on another is the usual one-GPU-per-rank layout, not a mismatch. The shape exchange
of the ragged gathers always compares device types (one more int64 per leaf); a call's description
names the device type of every leaf that is not on the CPU, so the guard and check mode tell a CUDA
call from a host one.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from popmesh.core.arrays import dtype_name, is_torch, leaf_shape
from popmesh.core.dtypes import DTYPES
from popmesh.core.errors import CollectiveMismatch

__all__ = [
    "exchange_texts", "describe_leaves", "device_type", "device_advice", "agree", "exchange_shapes",
    "exchange_all_shapes", "shape_row", "shapes_mismatch",
]


def describe_leaves(leaves: Sequence[Any], *, devices: bool = False) -> str:
    """``float32[3,4] int64[]`` — a readable signature of the leaves. A leaf off the CPU always names
    its device type (``float32[3,4]@cuda``): a CUDA tensor on one rank against a host one on another
    is a mismatch, not the same call. ``devices=True`` names every leaf's (``int64[]@cpu`` too)."""
    def one(x: Any) -> str:
        where = device_type(x)
        suffix = f"@{where}" if devices or where != "cpu" else ""
        return f"{dtype_name(x)}[{','.join(map(str, leaf_shape(x)))}]{suffix}"

    return " ".join(one(x) for x in leaves)


def device_type(x: Any) -> str:
    """The kind of device ``x`` lives on: a torch tensor's ``device.type`` (``cuda``, ``mps``,
    ``meta``...) without the index, which differs per rank; ``cpu`` for anything else."""
    return str(x.device.type) if is_torch(x) else "cpu"


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
        f"collective with the same structure, shapes and dtypes.{device_advice(texts)}",
        dict(zip(comm.ranks, texts)),
    )


def device_advice(texts: Sequence[str]) -> str:
    """What to do when the per-rank descriptions ``texts`` name different device types (``@cuda``
    beside ``@cpu``), with a leading space; empty when they name one type or none."""
    named = {m.group(1) for t in texts for m in _DEVICE.finditer(t)}
    if len(named) < 2:
        return ""
    text = (f" The ranks' tensors live on different kinds of device ({', '.join(sorted(named))}): put every "
            "rank's tensors of the call on the same kind, all on the CPU (.cpu()) or each rank's on its own "
            "GPU (.to(f'cuda:{local_rank}')).")
    if "cuda" in named:
        text += " CUDA tensors need the torch engine with nccl (popmesh launch --engine torch); MPI refuses them."
    return text


_DEVICE = re.compile(r"\]@([a-z_]+)")


def exchange_texts(comm: Any, text: str, width: int, timeout: float) -> list[str]:
    """Every member's ``text`` (UTF-8, cut to ``width`` bytes), gathered straight through the engine."""
    raw = text.encode()[:width]
    padded = np.zeros(width, dtype=np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    rows = comm.world.engine.all_gather(padded, comm.handle, timeout)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


_BY_CODE = {zlib.crc32(d.name.encode()): d.name for d in DTYPES}
_DEVICE_BY_CODE = {zlib.crc32(t.encode()): t for t in ("cpu", "cuda", "mps", "xpu", "hpu", "meta", "xla")}
_DEVICE_CODES: dict[str, int] = {}


def _device_code(x: Any) -> int:
    kind = device_type(x)
    code = _DEVICE_CODES.get(kind)
    if code is None:
        code = _DEVICE_CODES[kind] = zlib.crc32(kind.encode())
    return code


def exchange_shapes(
    comm: Any, leaf: Any, what: str, timeout: float, *, same_leading: bool
) -> list[tuple[int, ...]]:
    """Every rank's shape of ``leaf`` (see :func:`exchange_all_shapes`)."""
    return exchange_all_shapes(comm, [leaf], what, timeout, same_leading=same_leading)[0]


def exchange_all_shapes(
    comm: Any, leaves: Sequence[Any], what: str, timeout: float, *, same_leading: bool
) -> list[list[tuple[int, ...]]]:
    """For each leaf, every rank's shape, in one small collective for all leaves. Raise
    CollectiveMismatch on every rank if dtypes, device types, numbers of dimensions or trailing
    dimensions differ (or leading ones, when ``same_leading``)."""
    rows = np.stack([shape_row(leaf, what) for leaf in leaves]) if leaves else np.empty((0, 11), np.int64)
    tables = comm.world.engine.all_gather(rows, comm.handle, timeout)  # [rank, leaf, 11]
    first = 3 if same_leading else 4
    out = []
    for i in range(len(leaves)):
        table = tables[:, i]
        if not ((table[:, :3] == table[0, :3]).all() and (table[:, first:] == table[0, first:]).all()):
            raise shapes_mismatch(what, dict(zip(comm.ranks, table)), same_leading)
        out.append([tuple(int(d) for d in r[3 : 3 + int(r[2])]) for r in table])
    return out


def shape_row(leaf: Any, what: str) -> np.ndarray:
    """What :func:`exchange_all_shapes` tells the other ranks of ``leaf``: 11 int64 words, a code of
    its dtype, a code of its device type, its number of dimensions and up to 8 dimensions (-1 after)."""
    shape = leaf_shape(leaf)
    if len(shape) > 8:
        raise ValueError(f"{what}: arrays of more than 8 dimensions are not supported (got {len(shape)})")
    row = np.full(11, -1, dtype=np.int64)
    row[0] = zlib.crc32(dtype_name(leaf).encode())
    row[1] = _device_code(leaf)
    row[2] = len(shape)
    row[3 : 3 + len(shape)] = shape
    return row


def shapes_mismatch(what: str, rows: dict[int, np.ndarray], same_leading: bool) -> CollectiveMismatch:
    """The error of :func:`exchange_all_shapes` from each rank's row (keyed by global rank): each
    rank's dtype and shape, and its device type where the ranks' device types differ."""
    devices = len({int(row[1]) for row in rows.values()}) > 1
    per_rank = {r: _row_text(row, devices) for r, row in rows.items()}
    listing = "; ".join(f"rank {r}: {t}" for r, t in per_rank.items())
    need = "the same shape" if same_leading else "the same dtype and trailing dimensions"
    return CollectiveMismatch(f"{what}: every rank must pass {need} on the same kind of device ({listing})."
                              f"{device_advice(list(per_rank.values()))}", per_rank)


def _row_text(row: np.ndarray, device: bool) -> str:
    dims = ",".join(str(int(d)) for d in row[3 : 3 + int(row[2])])
    text = f"{_BY_CODE.get(int(row[0]), 'unknown dtype')}[{dims}]"
    return f"{text}@{_DEVICE_BY_CODE.get(int(row[1]), 'other')}" if device else text
