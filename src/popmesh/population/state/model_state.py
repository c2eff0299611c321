"""Moving a torch module's weights: flatten per dtype into contiguous buffers, load back in place.

A population mechanism moves whole models, so it works on a :class:`FlatState`: one contiguous 1-D
tensor per dtype holding every parameter (and optionally every floating buffer) of that dtype, in
``named_parameters()`` order, described by a pure :class:`Layout`. Two ranks with the same
architecture have the same Layout and the same :meth:`Layout.fingerprint`, which the mechanisms
compare before exchanging anything. Optimizer state (Adam moments, step counts) travels as a flat
dict of named tensors (:func:`optimizer_tensors` / :func:`load_optimizer_tensors_`).

Devices: :func:`snapshot`, :func:`refresh_` and :func:`load_` stay on the model's device (one
``torch.cat`` per dtype there, and one copy per dtype where a snapshot comes from another device),
so a model on a GPU whose engine reduces on the device (nccl) never touches host memory. Where host
copies are needed (:func:`to_numpy`, :func:`optimizer_tensors`, and :func:`from_numpy` onto a GPU),
a CUDA model's tensors go through pinned host memory by non-blocking copies with one
synchronisation for all of them, never a blocking round trip per tensor. These CUDA paths are
untested on GPU; CPU tensors take the plain path, without pinned memory or extra copies.

torch is imported only when a function that needs it runs.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from popmesh.core.dtypes import ITEMSIZE
from popmesh.core.errors import ConfigError
from popmesh.core.flat import copy_back, flatten_into, group_indices, numel_of, packed_offsets, views_of

__all__ = [
    "Entry",
    "Layout",
    "FlatState",
    "model_tensors",
    "layout_of",
    "snapshot",
    "refresh_",
    "load_",
    "tensors_of",
    "to_numpy",
    "from_numpy",
    "pack_bytes",
    "unpack_bytes",
    "optimizer_tensors",
    "load_optimizer_tensors_",
]

_ALIGN = 8


@dataclass(frozen=True)
class Entry:
    """One tensor of a layout: ``numel`` elements at element ``offset`` of its dtype's buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    """Where every named tensor lives in the per-dtype flat buffers. Pure data."""

    entries: tuple[Entry, ...]

    @classmethod
    def from_specs(cls, specs: Sequence[tuple[str, str, Sequence[int]]]) -> Layout:
        """A layout from ``(name, dtype, shape)`` triples, packed per dtype in the order given."""
        for name, dtype, _ in specs:
            if dtype not in ITEMSIZE:
                raise ConfigError(f"tensor {name!r} has dtype {dtype}, which population policies cannot move")
        numels = [numel_of(shape) for _, _, shape in specs]
        offsets = [0] * len(specs)
        for idx in group_indices([dtype for _, dtype, _ in specs]):
            for i, offset in zip(idx, packed_offsets([numels[i] for i in idx])[0]):
                offsets[i] = offset
        return cls(tuple(Entry(name, dtype, tuple(int(s) for s in shape), offset, numel)
                         for (name, dtype, shape), offset, numel in zip(specs, offsets, numels)))

    @functools.cached_property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes present, in order of first appearance."""
        return tuple(dict.fromkeys(e.dtype for e in self.entries))

    @functools.cached_property
    def names_by_dtype(self) -> Mapping[str, tuple[str, ...]]:
        """``dtype -> names`` in buffer order (read-only, cached: snapshots ask for it every decision)."""
        return types.MappingProxyType({dt: tuple(e.name for e in self.entries if e.dtype == dt) for dt in self.dtypes})

    def numel(self, dtype: str) -> int:
        """Elements of the flat buffer of ``dtype``."""
        return sum(e.numel for e in self.entries if e.dtype == dtype)

    def byte_table(self) -> dict[str, tuple[int, int]]:
        """``dtype -> (byte offset, byte length)`` when all buffers are packed into one byte array,
        each buffer starting at an 8-byte boundary (see :func:`pack_bytes`)."""
        table, pos = {}, 0
        for dt in self.dtypes:
            n = self.numel(dt) * ITEMSIZE[dt]
            table[dt] = (pos, n)
            pos += -(-n // _ALIGN) * _ALIGN
        return table

    @property
    def nbytes(self) -> int:
        """Length of the packed byte form."""
        return sum(-(-n // _ALIGN) * _ALIGN for _, n in self.byte_table().values())

    def fingerprint(self) -> int:
        """A 52-bit hash of names, dtypes and shapes: exact as a float64, equal iff layouts match."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> int:
        text = ";".join(f"{e.name}:{e.dtype}:{e.shape}" for e in self.entries)
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 12

    def describe(self) -> str:
        """A short human-readable summary (tensor count and size per dtype)."""
        parts = [f"{self.numel(dt)} {dt}" for dt in self.dtypes]
        return f"{len(self.entries)} tensors ({', '.join(parts) or 'empty'})"


@dataclass
class FlatState:
    """One contiguous 1-D tensor per dtype (``buffers``) laid out by ``layout``."""

    layout: Layout
    buffers: dict[str, Any]


def _torch() -> Any:
    import torch

    return torch


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def model_tensors(model: Any, include_buffers: bool = False) -> dict[str, Any]:
    """The tensors a policy moves: every parameter, plus every floating buffer if asked.

    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are counters, not weights: they are
    never averaged or copied.
    """
    named = {name: p for name, p in model.named_parameters()}
    if include_buffers:
        named.update({f"buffer:{name}": b for name, b in model.named_buffers()
                      if b is not None and b.is_floating_point()})
    if not named:
        raise ConfigError(f"{type(model).__name__} has no parameters to move")
    return named


def layout_of(tensors: Mapping[str, Any]) -> Layout:
    """The Layout of named tensors (all on one device)."""
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) > 1:
        raise ConfigError(f"the model's tensors live on several devices {sorted(devices)}; population "
                          "policies move models that live on one device")
    return _layout(tuple((n, _dtype_name(t), tuple(t.shape)) for n, t in tensors.items()))


@functools.lru_cache(maxsize=64)
def _layout(specs: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Layout:
    """Layouts are pure data of their specs: policies ask for the same one every decision."""
    return Layout.from_specs(specs)


def snapshot(tensors: Mapping[str, Any], layout: Layout | None = None) -> FlatState:
    """A consistent copy of ``tensors``, one contiguous buffer per dtype, on their device (a GPU
    model's snapshot stays on the GPU: no host copy; untested on GPU)."""
    torch = _torch()
    layout = layout_of(tensors) if layout is None else layout
    device = next(iter(tensors.values())).device
    buffers = {dt: torch.empty(layout.numel(dt), dtype=getattr(torch, dt), device=device) for dt in layout.dtypes}
    flat = FlatState(layout, buffers)
    refresh_(flat, tensors)
    return flat


def _check_same(layout: Layout, tensors: Mapping[str, Any]) -> None:
    names = [e.name for e in layout.entries]
    if list(tensors) != names:
        raise ConfigError(f"the model changed its tensors: expected {layout.describe()}, got {len(tensors)} "
                          "tensors with other names; population policies need a fixed architecture")


def refresh_(flat: FlatState, tensors: Mapping[str, Any]) -> FlatState:
    """Copy the current values of ``tensors`` into ``flat``'s buffers (no allocation)."""
    torch = _torch()
    _check_same(flat.layout, tensors)
    with torch.no_grad():  # one cat per dtype: a snapshot runs between training steps, cold
        for dt, names in flat.layout.names_by_dtype.items():
            flatten_into([tensors[n] for n in names], out=flat.buffers[dt])
    return flat


def load_(tensors: Mapping[str, Any], flat: FlatState) -> None:
    """Write ``flat`` into ``tensors`` in place (values are cast to each tensor's dtype and device).

    A buffer on another device than its tensors moves there in one copy per dtype (non-blocking onto
    a GPU), then is written tensor by tensor on that device: never one host round trip per tensor.
    Buffers already on the tensors' device (the CPU path, a GPU snapshot) are written as they are.
    Cross-device loads are untested on GPU."""
    torch = _torch()
    _check_same(flat.layout, tensors)
    with torch.no_grad():
        for dt, names in flat.layout.names_by_dtype.items():
            targets = [tensors[n] for n in names]
            source = flat.buffers[dt]
            if source.device != targets[0].device:
                source = source.to(targets[0].device, non_blocking=targets[0].is_cuda)
            copy_back(source, targets)


def tensors_of(flat: FlatState) -> dict[str, Any]:
    """Each named tensor of ``flat`` as a view into its buffer, in the layout's shape."""
    return {e.name: views_of(flat.buffers[e.dtype], [e.shape], [e.offset])[0] for e in flat.layout.entries}


def to_numpy(flat: FlatState) -> dict[str, np.ndarray]:
    """CPU numpy copies of the buffers; bfloat16 (which numpy lacks) becomes float32.

    Buffers on a GPU are copied into pinned host memory, each dtype's flat buffer by one
    non-blocking copy, with one synchronisation for all of them (untested on GPU)."""
    torch = _torch()
    buffers = flat.buffers
    if buffers and next(iter(buffers.values())).is_cuda:
        hosts = _pinned_copies(list(buffers.values()))
        return {dt: (h.to(torch.float32) if dt == "bfloat16" else h).numpy() for dt, h in zip(buffers, hosts)}
    out = {}
    for dt, buf in buffers.items():
        host = buf.detach().to("cpu")
        out[dt] = (host.to(torch.float32) if dt == "bfloat16" else host).numpy().copy()
    return out


def _pinned_copies(tensors: Sequence[Any]) -> list[Any]:
    """Host copies of CUDA ``tensors`` in pinned memory: one non-blocking copy each, then one
    synchronisation of the streams that carry them (untested on GPU)."""
    torch = _torch()
    hosts = [torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(hosts, tensors):
        host.copy_(t.detach(), non_blocking=True)
    for device in {t.device for t in tensors}:
        torch.cuda.current_stream(device).synchronize()
    return hosts


def from_numpy(layout: Layout, arrays: Mapping[str, np.ndarray], device: Any = "cpu") -> FlatState:
    """A FlatState of ``layout`` from per-dtype numpy arrays (cast to each dtype of the layout).

    Onto a GPU, each array is cast into pinned host memory and copied to the device without blocking
    (the copies are ordered before later work on the current stream, :func:`load_`'s included;
    untested on GPU)."""
    torch = _torch()
    to_gpu = str(device).startswith("cuda")
    buffers = {}
    for dt in layout.dtypes:
        a = np.ascontiguousarray(arrays[dt]).reshape(-1)
        if a.size != layout.numel(dt):
            raise ConfigError(f"{dt} buffer has {a.size} elements, the layout needs {layout.numel(dt)}")
        if to_gpu:
            staging = torch.empty(a.size, dtype=getattr(torch, dt), pin_memory=True)
            staging.copy_(torch.from_numpy(a))
            buffers[dt] = staging.to(device, non_blocking=True)
        else:
            buffers[dt] = torch.from_numpy(a).to(device=device, dtype=getattr(torch, dt))
    return FlatState(layout, buffers)


def _raw_bytes(t: Any) -> np.ndarray:
    torch = _torch()
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def pack_bytes(flat: FlatState, out: np.ndarray) -> None:
    """Write every buffer's raw bytes into the uint8 array ``out`` following ``layout.byte_table()``."""
    for dt, (start, n) in flat.layout.byte_table().items():
        out[start:start + n] = _raw_bytes(flat.buffers[dt])


def unpack_bytes(layout: Layout, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Per-dtype numpy arrays (bfloat16 as float32) from the packed bytes of :func:`pack_bytes`."""
    torch = _torch()
    out = {}
    for dt, (start, n) in layout.byte_table().items():
        t = torch.from_numpy(np.array(raw[start:start + n], dtype=np.uint8)).view(getattr(torch, dt))
        out[dt] = (t.to(torch.float32) if dt == "bfloat16" else t).numpy()
    return out


def optimizer_tensors(optimizer: Any) -> dict[str, Any]:
    """An optimizer's per-parameter state as ``{"<param index>/<key>": tensor}`` (CPU copies).

    Plain numbers in the state (some optimizers keep ``step`` as a float) become 0-d float64
    tensors; :func:`load_optimizer_tensors_` restores tensors, which torch optimizers accept. State
    on a GPU is copied into pinned host memory without blocking, with one synchronisation for all
    of it (untested on GPU).
    """
    torch = _torch()
    out = {}
    on_gpu: dict[str, Any] = {}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value) and value.is_cuda:
                out[f"{index}/{key}"] = on_gpu[f"{index}/{key}"] = value
            elif torch.is_tensor(value):
                out[f"{index}/{key}"] = value.detach().to("cpu").clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{index}/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    if on_gpu:
        out.update(zip(on_gpu, _pinned_copies(list(on_gpu.values()))))
    return out


def load_optimizer_tensors_(optimizer: Any, tensors: Mapping[str, Any]) -> None:
    """Replace ``optimizer``'s per-parameter state with ``tensors`` (from :func:`optimizer_tensors`),
    keeping its own hyper-parameters (param groups). torch casts and moves state to each parameter."""
    torch = _torch()
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        index, _, key = name.partition("/")
        if not index.isdigit() or not key:
            raise ConfigError(f"optimizer state key {name!r} is not '<param index>/<name>'")
        state.setdefault(int(index), {})[key] = value if torch.is_tensor(value) else torch.as_tensor(value)
    full = optimizer.state_dict()
    known = {i for g in full["param_groups"] for i in g["params"]}
    if not set(state) <= known:
        raise ConfigError(f"donor optimizer state covers parameters {sorted(set(state) - known)} that this "
                          "optimizer does not have: copy needs the same optimizer on every rank")
    full["state"] = state
    optimizer.load_state_dict(full)
