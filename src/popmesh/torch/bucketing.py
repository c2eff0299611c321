"""Bucket plans for gradient synchronisation: which parameters share one collective, and where.

A gradient sync that averages with one collective per bucket (DDP's 25 MiB buckets, Horovod's
tensor fusion) first needs a layout: parameters grouped by (dtype, device), in the order their
gradients become ready, packed into flat buffers of at most ``cap_bytes``. This module computes that
layout from plain descriptors (:class:`ParamSpec`, strings only, no torch import) so it can be
tested without processes and compared across ranks by :meth:`BucketPlan.fingerprint`.

Contract: every rank of a group must plan from the same specs with the same options, and must
check that with the fingerprint before the first collective.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from popmesh.core.dtypes import canonical_dtype, itemsize
from popmesh.core.errors import ConfigError

__all__ = [
    "DEFAULT_CAP_BYTES",
    "ParamSpec",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "plan_differs",
]

DEFAULT_CAP_BYTES = 25 * 2**20
"""25 MiB, DDP's default ``bucket_cap_mb``."""

@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the planner sees it: name, element count, dtype name and device string.

    ``dtype`` is normalised (``"torch.float32"`` becomes ``"float32"``) so torch, numpy and JAX
    descriptions of the same model plan identically.
    """

    name: str
    numel: int
    dtype: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"parameter name must be a string, got {self.name!r}")
        if not _is_int(self.numel) or self.numel < 0:
            raise ConfigError(f"parameter {self.name!r}: numel must be a non-negative int, "
                              f"got {self.numel!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"parameter {self.name!r}: device must be a non-empty string "
                              "like 'cpu' or 'cuda:0'")
        object.__setattr__(self, "numel", int(self.numel))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole parameter."""
        return self.numel * self.itemsize

    @classmethod
    def from_array(cls, name: str, array: Any) -> ParamSpec:
        """Describe a torch tensor, numpy array or JAX array by duck typing (nothing is imported)."""
        numel = array.numel() if callable(getattr(array, "numel", None)) else array.size
        device = getattr(array, "device", "cpu")
        device = device() if callable(device) else device
        return cls(name, int(numel), str(array.dtype), str(device))


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a single dtype on a single device.

    Parameter ``indices[j]`` (a position in the plan's specs) occupies elements
    ``offsets[j] : offsets[j] + sizes[j]`` of a buffer of ``numel`` elements (padding included).
    """

    dtype: str
    device: str
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer, padding included."""
        return self.numel * itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {"dtype": self.dtype, "device": self.device, "indices": list(self.indices),
                "offsets": list(self.offsets), "sizes": list(self.sizes), "numel": self.numel}


@dataclass(frozen=True)
class BucketPlan:
    """The full layout: the specs it was planned from, the options, and the buckets in ready order."""

    specs: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    cap_bytes: int
    align_bytes: int
    order: str
    _where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = {i: (b, off) for b, bucket in enumerate(self.buckets)
                 for i, off in zip(bucket.indices, bucket.offsets)}
        object.__setattr__(self, "_where", where)

    def locate(self, index: int) -> tuple[int, int]:
        """``(bucket position, element offset)`` of parameter ``index`` (its position in ``specs``)."""
        try:
            return self._where[index]
        except KeyError:
            raise ConfigError(f"parameter index {index} is not in this plan of {len(self.specs)} "
                              "parameters") from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description of the plan: options, parameters and buckets."""
        return {
            "format": 1, "cap_bytes": self.cap_bytes, "align_bytes": self.align_bytes, "order": self.order,
            "params": [{"name": s.name, "numel": s.numel, "dtype": s.dtype, "device": s.device}
                       for s in self.specs],
            "buckets": [b.to_dict() for b in self.buckets],
        }

    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of the layout, for ranks to check they planned the same.

        Devices enter only by type (``"cuda:3"`` counts as ``"cuda"``), because each rank holds its
        parameters on its own device index; names, sizes, dtypes, offsets and options all count.
        """
        data = self.to_dict()
        for entry in data["params"] + data["buckets"]:
            entry["device"] = entry["device"].split(":", 1)[0]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_int(value: object) -> bool:
    """An integer (numpy's included) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_options(cap_bytes: int, align_bytes: int, order: str) -> None:
    if not _is_int(cap_bytes) or cap_bytes <= 0:
        raise ConfigError(f"cap_bytes must be a positive int, got {cap_bytes!r}; DDP uses 25 MiB")
    if not _is_int(align_bytes) or align_bytes < 0 or align_bytes & (align_bytes - 1):
        raise ConfigError(f"align_bytes must be 0 (packed) or a power of two such as 64, got {align_bytes!r}")
    if order not in ("reverse", "forward"):
        raise ConfigError(f"order must be 'reverse' (backward ready order) or 'forward', got {order!r}")


def _as_specs(specs: Iterable[ParamSpec | Sequence[Any]]) -> tuple[ParamSpec, ...]:
    try:
        out = tuple(s if isinstance(s, ParamSpec) else ParamSpec(*s) for s in specs)
    except TypeError as e:
        raise ConfigError("each spec must be a ParamSpec or a (name, numel, dtype[, device]) tuple; "
                          f"got an entry that is neither ({e})") from e
    dups = sorted(name for name, count in Counter(s.name for s in out).items() if count > 1)
    if dups:
        raise ConfigError(f"parameter names must be unique, repeated: {dups}")
    return out


class _Open:
    """A bucket being filled."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.indices: list[int] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.end = 0

    def close(self) -> Bucket:
        return Bucket(self.key[0], self.key[1], tuple(self.indices), tuple(self.offsets),
                      tuple(self.sizes), self.end)


def _align_up(offset: int, step: int) -> int:
    return -(-offset // step) * step


def plan_buckets(specs: Iterable[ParamSpec | Sequence[Any]], *, cap_bytes: int = DEFAULT_CAP_BYTES,
                 order: Literal["reverse", "forward"] = "reverse", align_bytes: int = 0) -> BucketPlan:
    """Group parameters into buckets of one (dtype, device) each, at most ``cap_bytes`` per bucket.

    Parameters are visited in reverse registration order by default (the order gradients become
    ready during backward, like DDP) or in ``order="forward"``; each joins the open bucket of its
    (dtype, device) unless that would exceed ``cap_bytes``, in which case that bucket is closed
    and a new one started, so a parameter larger than the cap gets a bucket of its own. Buckets
    are listed in the order they were opened. ``align_bytes=0`` packs parameters back to back (as
    DDP does); a power of two such as 64 starts every parameter on that byte boundary (cache-line
    and vector friendly), at the cost of some padding, which counts towards the cap. ``specs``
    entries may be :class:`ParamSpec` or ``(name, numel, dtype[, device])`` tuples.
    """
    _check_options(cap_bytes, align_bytes, order)
    spec_tuple = _as_specs(specs)
    visit = range(len(spec_tuple) - 1, -1, -1) if order == "reverse" else range(len(spec_tuple))
    open_: dict[tuple[str, str], _Open] = {}
    done: list[_Open] = []
    for i in visit:
        spec = spec_tuple[i]
        key, size = (spec.dtype, spec.device), spec.itemsize
        cur = open_.get(key)
        offset = 0 if cur is None else _align_up(cur.end, max(1, align_bytes // size))
        if cur is not None and (offset + spec.numel) * size > cap_bytes:
            cur, offset = None, 0
        if cur is None:
            cur = open_[key] = _Open(key)
            done.append(cur)
        cur.indices.append(i)
        cur.offsets.append(offset)
        cur.sizes.append(spec.numel)
        cur.end = offset + spec.numel
    return BucketPlan(spec_tuple, tuple(b.close() for b in done), int(cap_bytes), int(align_bytes), order)


def plan_differs(plan: BucketPlan, specs: Iterable[ParamSpec | Sequence[Any]]) -> bool:
    """True when ``specs`` (names, sizes, dtypes, devices, in order) are not what ``plan`` was made from.

    Call it when parameters may have changed (a rebuilt model, a new device) to know when to re-plan.
    """
    return _as_specs(specs) != plan.specs
