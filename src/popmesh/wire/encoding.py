"""Encoding popmesh wire frames: the one framed format of point-to-point messages.

Every engine carries the same bytes: :func:`encode` is a pure function of the payload, so a message
sent over torch.distributed and over MPI is byte-for-byte identical, and either side can decode it.
The frame layout (a fixed 32-byte header, ``ndim`` shape entries, then the payload) is documented
in :mod:`popmesh.wire.format`.

Checksum cost: the payload checksum is XXH3-64 (:mod:`popmesh.wire.format` says why), ~39 GB/s on
a 336 KB payload in cache and ~9 GB/s on 64 MiB streamed from memory on the development box
(a 64 MiB memcpy there: ~3-6 GB/s). ``checksum=None`` covers payloads up to
:data:`CHECKSUM_AUTO_LIMIT` bytes and leaves larger ones to the transport's own integrity checks;
pass ``checksum=True`` to always cover it, False to cover none (small frames from
:func:`encode_message` are always covered: deciding costs more). The header is always checksummed.

Common messages: :func:`encode_message` (what ``popmesh.send`` uses) returns small bytes and numpy
frames as one buffer built in one pass and frames larger contiguous numpy arrays without
:func:`encode`'s dispatch, and :func:`decode` takes a fast path for BYTES and NDARRAY frames that
returns only when every check of the full path passes; the bytes on the wire are the same either way.

No pickle by default: anything that is not bytes, an array, a tensor, a JSON-able value or a dict
of str to arrays needs ``allow_pickle=True`` on both the sender and the receiver. Decoding a
truncated, corrupt or foreign frame raises :class:`~popmesh.core.errors.MessageError`.

This module encodes; decoding lives in :mod:`popmesh.wire.decoding` and the buffer helpers
(:func:`join_frame`, :func:`frame_nbytes`) in :mod:`popmesh.wire.format`; :mod:`popmesh.wire`
re-exports the public names of all three.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from popmesh.core.arrays import is_torch
from popmesh.core.errors import MessageError
from popmesh.wire.format import (
    CHECKSUM_AUTO_LIMIT,
    CRC,
    DEVICE_CODES,
    DTYPE_CODES,
    FIXED_HEADER,
    FLAG_PAYLOAD_CRC,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    NATIVE_DTYPE_CODES,
    SHAPE_STRUCTS,
    SMALL_FRAME_NBYTES,
    UINT8_CODE,
    Kind,
    PayloadHasher,
    as_bytes_view,
    frame_nbytes,
    import_torch,
    is_jax,
    payload_digest,
)

__all__ = ["encode", "encode_message"]

# --- encoding -------------------------------------------------------------------------------

_Body = tuple[Kind, int, int, tuple[int, ...], memoryview]  # kind, dtype code, device code, shape, data


def _numpy_body(arr: np.ndarray) -> _Body | None:
    """A numpy array's frame fields and data view, or None if its dtype has no code."""
    code = DTYPE_CODES.get(arr.dtype.name)
    if code is None:
        return None
    if arr.dtype != arr.dtype.newbyteorder("<"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # ascontiguousarray turns 0-d into 1-d
    return Kind.NDARRAY, code, 0, arr.shape, memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only on 3.12+


def _torch_body(t: Any) -> _Body | None:
    """A torch tensor's frame fields and (CPU) data view, or None if it cannot be framed."""
    torch = import_torch()
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_CODES:
        return None
    device = DEVICE_CODES.get(t.device.type, 255)
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    arr = (t.view(torch.int16) if name == "bfloat16" else t).numpy()
    return Kind.TORCH, DTYPE_CODES[name], device, tuple(t.shape), memoryview(arr.reshape(-1).view(np.uint8))


def _array_body(x: Any) -> _Body | None:
    """Frame fields and data of an array-like payload (numpy, torch, jax), else None."""
    if is_torch(x):
        return _torch_body(x)
    if type(x) is np.ndarray or is_jax(x):
        return _numpy_body(np.asarray(x))
    return None


def _is_json(x: Any, depth: int = 0) -> bool:
    """True for values JSON carries back unchanged: exact dict[str, ...], list, str, int, float, bool, None."""
    t = type(x)
    if x is None or t in (str, int, float, bool):
        return True
    if depth > 200:
        return False
    if t is list:
        return all(_is_json(v, depth + 1) for v in x)
    if t is dict:
        return all(type(k) is str and _is_json(v, depth + 1) for k, v in x.items())
    return False


def _culprit(payload: Any) -> str:
    """``: payload["a"][0] is a tuple`` for the first part of a dict or list payload that neither JSON
    nor a batch carries (so the sender of a big message learns where to look); ``""`` otherwise."""
    found = _unsendable(payload, "") if type(payload) in (dict, list) else None
    return "" if found is None else f": payload{found[0]} {found[1]}"


def _unsendable(x: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """(path, what is wrong there) of the first part of ``x`` that needs pickle, or None if there is none.
    A dict holding an array is read as a batch (every value an array), any other dict as JSON."""
    if depth > 200:
        return path, "nests deeper than 200 levels"
    t = type(x)
    if t is dict:
        batch = any(_array_like(v) for v in x.values())
        for key, value in x.items():
            if type(key) is not str:
                return path, f"has the key {key!r}, {_a(type(key))} (keys must be str)"
            here = f"{path}[{json.dumps(key)}]"
            if batch and _array_like(value) and _array_body(value) is None:
                return here, (f"is {_a(type(value))} of dtype {value.dtype} on {getattr(value, 'device', 'cpu')}, "
                              "which no frame carries")
            if batch and _array_body(value) is None:
                return here, (f"is {_a(type(value))} in a dict of arrays (a batch holds only arrays and tensors; "
                              "send other values apart)")
            found = None if batch else _unsendable(value, here, depth + 1)
            if found is not None:
                return found
        return None
    if t is list:
        for i, value in enumerate(x):
            found = _unsendable(value, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
        return None
    return None if x is None or t in (str, int, float, bool) else (path, f"is {_a(t)}")


def _array_like(x: Any) -> bool:
    return is_torch(x) or type(x) is np.ndarray or is_jax(x)


def _a(t: type) -> str:
    """``a tuple``, ``an object``: a type's name with its article."""
    name = t.__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _frame(kind: Kind, dtype: int, device: int, shape: Sequence[int], body: list[Any],
           checksum: bool | None) -> list[bytes | memoryview]:
    """Prepend the header to ``body`` (flat byte buffers)."""
    nbytes = sum(len(b) for b in body)
    covered = nbytes <= CHECKSUM_AUTO_LIMIT if checksum is None else bool(checksum)
    digest = 0
    if covered:
        hasher = PayloadHasher()
        for part in body:
            hasher.update(part)
        digest = hasher.intdigest()
    fixed = FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, kind, FLAG_PAYLOAD_CRC if covered else 0, dtype, device,
                              len(shape), 0, digest, nbytes)
    shape_bytes = SHAPE_STRUCTS[len(shape)].pack(*shape)
    header = fixed + CRC.pack(zlib.crc32(shape_bytes, zlib.crc32(fixed))) + shape_bytes
    return [header, *body]


def _batch_bodies(x: Any) -> list[_Body] | None:
    """Bodies of a dict of str -> arrays/tensors (a replay batch), or None if ``x`` is not one."""
    if type(x) is not dict or not all(type(k) is str for k in x):
        return None
    bodies = []
    for value in x.values():
        body = _array_body(value)
        if body is None:
            return None
        bodies.append(body)
    return bodies


def _encode_batch(keys: list[str], bodies: list[_Body], checksum: bool | None) -> list[bytes | memoryview]:
    index = json.dumps({"keys": keys}, separators=(",", ":")).encode("ascii")
    index += b" " * (-len(index) % 8)
    parts: list[Any] = [index]
    for kind, dtype, device, shape, data in bodies:
        sub = _frame(kind, dtype, device, shape, [data], checksum=False)
        pad = -frame_nbytes(sub) % 8
        parts += [*sub, bytes(pad)] if pad else sub
    return _frame(Kind.DICT, 0, 0, (len(index),), parts, checksum)


def encode(payload: Any, *, allow_pickle: bool = False, checksum: bool | None = None) -> list[bytes | memoryview]:
    """Frame ``payload`` as a list of buffers: the header, then views of the payload's data.

    Arrays and tensors are not copied (except non-contiguous ones, big-endian ones and tensors
    off the CPU), so the list is valid while ``payload`` is unchanged; engines send the buffers
    as they are or :func:`join_frame` them. ``checksum``: True/False covers the payload with the
    CRC or not; None covers payloads up to :data:`CHECKSUM_AUTO_LIMIT` bytes. Raises MessageError
    for a payload that needs pickle when ``allow_pickle`` is False.
    """
    if isinstance(payload, (bytes, bytearray, memoryview)):
        data = as_bytes_view(payload)
        return _frame(Kind.BYTES, DTYPE_CODES["uint8"], 0, (len(data),), [data], checksum)
    array = _array_body(payload)
    if array is not None:
        kind, dtype, device, shape, data = array
        return _frame(kind, dtype, device, shape, [data], checksum)
    bodies = _batch_bodies(payload)
    if bodies is not None:
        return _encode_batch(list(payload), bodies, checksum)
    if _is_json(payload):
        text = json.dumps(payload, separators=(",", ":"), allow_nan=True).encode("ascii")
        return _frame(Kind.JSON, 0, 0, (), [text], checksum)
    if not allow_pickle:
        raise MessageError(
            f"cannot send a {type(payload).__qualname__} without pickle{_culprit(payload)}: popmesh sends bytes, "
            "numpy arrays, torch tensors, JSON values (dict with str keys, list, str, int, float, bool, None; no "
            "tuples) and dicts of str to arrays. Convert it (numpy scalars: np.asarray(x) or x.item()), or pass "
            "allow_pickle=True to both encode and decode (trusted peers only).")
    try:
        pickled = pickle.dumps(payload, protocol=5)
    except Exception as e:
        raise MessageError(f"cannot pickle a {type(payload).__qualname__}: {e}") from e
    return _frame(Kind.PICKLE, 0, 0, (), [pickled], checksum)


def _small_frame(kind: int, dtype: int, shape: tuple[int, ...], data: bytes) -> bytes:
    """The whole frame of a small, checksummed payload as one bytes object (same bytes as encode)."""
    fixed = FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, kind, FLAG_PAYLOAD_CRC, dtype, 0, len(shape), 0,
                              payload_digest(data), len(data))
    shape_bytes = SHAPE_STRUCTS[len(shape)].pack(*shape)
    return b"".join((fixed, CRC.pack(zlib.crc32(shape_bytes, zlib.crc32(fixed))), shape_bytes, data))


def encode_message(payload: Any, *, allow_pickle: bool = False,
                   checksum: bool | None = None) -> bytes | list[bytes | memoryview]:
    """:func:`encode` for sending: the same frame bytes, but a small frame comes back as one buffer.

    Bytes and contiguous native numpy arrays of at most :data:`SMALL_FRAME_NBYTES` bytes are framed
    in one pass into one ``bytes`` (a copy, so the payload may change at once), always with their
    payload checksum (it costs less than deciding); everything else is :func:`encode`'s list of
    buffers, with ``checksum`` as there (larger contiguous native numpy arrays take a shorter way
    to the same list: after a multi-megabyte transfer every cache is cold, and encode's dispatch
    alone cost tens of microseconds). The transports send either.
    """
    t = type(payload)
    if t is bytes:
        if len(payload) <= SMALL_FRAME_NBYTES:
            return _small_frame(Kind.BYTES, UINT8_CODE, (len(payload),), payload)
    elif t is np.ndarray:
        code = NATIVE_DTYPE_CODES.get(payload.dtype)
        if code is not None and payload.ndim <= MAX_NDIM:
            if payload.nbytes <= SMALL_FRAME_NBYTES:
                return _small_frame(Kind.NDARRAY, code, payload.shape, payload.tobytes())
            if payload.flags.c_contiguous:  # encode's own path, minus its dispatch
                return _frame(Kind.NDARRAY, code, 0, payload.shape, [memoryview(payload).cast("B")], checksum)
    return encode(payload, allow_pickle=allow_pickle, checksum=checksum)
