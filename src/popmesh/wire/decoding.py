"""Decoding popmesh wire frames (:mod:`popmesh.wire` re-exports :func:`decode` and :func:`read_header`).

The frame layout is in :mod:`popmesh.wire.format`. :func:`decode` first tries a fast path for
BYTES and numpy NDARRAY frames that returns only when every check of the full path passes;
anything else goes through :func:`read_header`, which raises the precise MessageError for a
truncated, corrupt or foreign frame.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import zlib
from typing import Any
from zlib import crc32

import numpy as np

from popmesh.core.arrays import is_torch
from popmesh.core.errors import MessageError
from popmesh.wire.format import (
    CRC,
    DEVICE_NAMES,
    DTYPE_NAMES,
    FIXED_HEADER,
    FLAG_PAYLOAD_CRC,
    FORMAT_VERSION,
    HEADER_NBYTES,
    KIND_VALUES,
    KINDS,
    MAGIC,
    MAX_NDIM,
    NUMPY_BY_CODE,
    SHAPE_STRUCTS,
    UINT8_CODE,
    FrameHeader,
    Kind,
    as_bytes_view,
    check_meta,
    import_torch,
    join_frame,
    numpy_dtype,
    payload_digest,
)

__all__ = ["decode", "read_header"]

WHOLE_HEADER = struct.Struct(FIXED_HEADER.format + "I")  # the 32 fixed bytes with the header CRC, in one unpack
SHAPE_1 = SHAPE_STRUCTS[1]
_UINT8 = np.dtype(np.uint8)
_BYTES = int(Kind.BYTES)


def _input_view(buf: Any) -> memoryview:
    """Accept bytes-likes, uint8 numpy arrays, CPU uint8 torch tensors or :func:`encode` output."""
    t = type(buf)
    if t is bytes or (t is np.ndarray and (buf.dtype is _UINT8 or buf.dtype == _UINT8) and buf.ndim == 1
                      and buf.flags.c_contiguous):  # identity first: a received frame's dtype is numpy's own
        return memoryview(buf)
    try:
        if isinstance(buf, (list, tuple)):
            return memoryview(join_frame(buf))  # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only on 3.12+
        if is_torch(buf):
            t = buf.detach().cpu().contiguous().reshape(-1)
            buf = (t if t.dtype == import_torch().uint8 else t.view(import_torch().uint8)).numpy()
        return as_bytes_view(buf)
    except (TypeError, AttributeError, RuntimeError) as e:
        raise MessageError(f"cannot decode a {type(buf).__qualname__}: pass bytes, a uint8 array or tensor, "
                           "or the list returned by encode()") from e


def read_header(buf: Any) -> FrameHeader:
    """Parse and validate the header at the start of ``buf`` (the payload may be absent).

    Raises MessageError for a short, foreign, corrupt or newer-version header.
    """
    mv = _input_view(buf)
    if len(mv) < HEADER_NBYTES:
        raise MessageError(f"truncated frame: {len(mv)} bytes, a frame header needs at least {HEADER_NBYTES}")
    magic, version, kind, flags, dtype, device, ndim, reserved, digest, nbytes = FIXED_HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise MessageError(f"not a popmesh frame (magic {bytes(magic)!r}, expected {MAGIC!r}): the sender did not "
                           "use popmesh.wire.encoding or the stream is misaligned")
    if version != FORMAT_VERSION:
        raise MessageError(f"frame format version {version} is not supported (this popmesh reads version "
                           f"{FORMAT_VERSION}); run the same popmesh version on every rank")
    if ndim > MAX_NDIM or len(mv) < HEADER_NBYTES + 8 * ndim:
        raise MessageError(f"truncated or corrupt frame: ndim {ndim} needs a {HEADER_NBYTES + 8 * ndim}-byte "
                           f"header, got {len(mv)} bytes")
    shape_bytes = mv[HEADER_NBYTES:HEADER_NBYTES + 8 * ndim]
    (stored,) = CRC.unpack_from(mv, FIXED_HEADER.size)
    if zlib.crc32(shape_bytes, zlib.crc32(mv[:FIXED_HEADER.size])) != stored:
        raise MessageError("corrupt frame: header checksum mismatch (the bytes were damaged or misaligned in transit)")
    if reserved or flags & ~FLAG_PAYLOAD_CRC or kind not in KIND_VALUES:
        raise MessageError(f"foreign frame: kind {kind}, flags {flags:#x} or reserved fields not understood")
    if (dtype and dtype not in DTYPE_NAMES) or (digest and not flags & FLAG_PAYLOAD_CRC):
        raise MessageError(f"foreign frame: unknown dtype code {dtype} or stray payload checksum")
    shape = SHAPE_STRUCTS[ndim].unpack(shape_bytes)
    if ndim and min(shape) < 0:
        raise MessageError(f"corrupt frame: negative shape {shape}")
    name = DTYPE_NAMES.get(dtype)
    kind = KINDS[kind]
    check_meta(kind, name, shape, nbytes, device)
    return FrameHeader(kind, name, DEVICE_NAMES[device] if kind == Kind.TORCH else None, shape, nbytes,
                       HEADER_NBYTES + 8 * ndim, bool(flags & FLAG_PAYLOAD_CRC), digest)


def _payload(mv: memoryview, head: FrameHeader, exact: bool) -> memoryview:
    """The payload bytes of the frame at the start of ``mv``; checks length and payload CRC."""
    have = len(mv) - head.header_nbytes
    if have < head.payload_nbytes or (exact and have != head.payload_nbytes):
        raise MessageError(f"truncated or overlong frame: the header announces a {head.payload_nbytes}-byte payload, "
                           f"{have} bytes follow it")
    data = mv[head.header_nbytes:head.frame_nbytes]
    if head.payload_checksummed and payload_digest(data) != head.payload_checksum:
        raise MessageError("corrupt frame: payload checksum mismatch (the bytes were damaged in transit)")
    return data


def _place(t: Any, device: Any, head: FrameHeader) -> Any:
    if device is None:
        return t
    same = isinstance(device, str) and device == "same"
    target = ("cpu" if head.device in (None, "other") else head.device) if same else device
    try:
        return t.to(target)
    except Exception as e:
        raise MessageError(f"cannot place the received tensor on device {target!r}: {e}; pass device=None "
                           "for CPU or a device this rank has") from e


def _decode_array(head: FrameHeader, data: memoryview, device: Any) -> Any:
    """NDARRAY/TORCH payload to an array or tensor; shares ``data`` when writable and aligned."""
    is_bf16_tensor = head.kind is Kind.TORCH and head.dtype == "bfloat16"
    arr = np.frombuffer(data, dtype=np.dtype("<i2") if is_bf16_tensor else numpy_dtype(str(head.dtype)))
    arr = arr.reshape(head.shape)
    if data.readonly or not arr.flags.aligned or not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if head.kind is Kind.NDARRAY:
        return arr
    torch = import_torch()
    t = torch.from_numpy(arr)
    return _place(t.view(torch.bfloat16) if is_bf16_tensor else t, device, head)


def _decode_batch(head: FrameHeader, data: memoryview, device: Any) -> dict[str, Any]:
    try:
        index = json.loads(bytes(data[:head.shape[0]]))
    except (ValueError, RecursionError) as e:
        raise MessageError(f"corrupt frame: unreadable DICT index ({e})") from e
    keys = index.get("keys") if type(index) is dict else None
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise MessageError("corrupt frame: the DICT index must list distinct string keys")
    out, pos = {}, head.shape[0]
    for key in keys:
        sub = read_header(data[pos:])
        if sub.kind not in (Kind.NDARRAY, Kind.TORCH):
            raise MessageError(f"foreign frame: DICT entry {key!r} is a {sub.kind.name} frame, not an array")
        out[key] = _decode_array(sub, _payload(data[pos:], sub, exact=False), device)
        pad = -sub.frame_nbytes % 8
        pos += sub.frame_nbytes
        if bytes(data[pos:pos + pad]) != bytes(pad):
            raise MessageError(f"corrupt frame: bad padding after DICT entry {key!r}")
        pos += pad
    if pos != len(data):
        raise MessageError(f"corrupt frame: {len(data) - pos} stray bytes after the DICT entries")
    return out


def _decode_plain(mv: memoryview) -> Any:
    """Fast path of :func:`decode` for the common frame: BYTES or a numpy NDARRAY, with or without
    its payload checksum (large arrays travel without one by default).

    Returns None unless every check of the full path passes, so anything unusual, foreign or corrupt
    goes through :func:`read_header` and :func:`_payload`, which raise the precise MessageError.
    After a multi-megabyte transfer every cache is cold and each Python step costs ~20x its warm
    time (the full path took 60 us to decode a 64 MB array, this one about half).
    """
    n = len(mv)
    if n < HEADER_NBYTES:
        return None
    magic, version, kind, flags, dtype, device, ndim, reserved, digest, nbytes, stored = WHOLE_HEADER.unpack_from(mv)
    header_nbytes = HEADER_NBYTES + 8 * ndim
    if (magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_PAYLOAD_CRC or device or reserved
            or ndim > MAX_NDIM or n != header_nbytes + nbytes or not 1 <= kind <= 2 or (digest and not flags)):
        return None
    if crc32(mv[HEADER_NBYTES:header_nbytes], crc32(mv[:FIXED_HEADER.size])) != stored:
        return None
    data = mv[header_nbytes:]
    if flags and payload_digest(data) != digest:
        return None
    if kind == _BYTES:  # a plain int: an IntEnum member's lookup costs more than the compare
        plain = dtype == UINT8_CODE and ndim == 1 and nbytes == SHAPE_1.unpack_from(mv, HEADER_NBYTES)[0]
        return bytes(data) if plain else None
    np_dtype = NUMPY_BY_CODE.get(dtype)
    if np_dtype is None:
        return None
    if ndim == 1:  # frombuffer's array is 1-d already, and its length is the shape
        if SHAPE_1.unpack_from(mv, HEADER_NBYTES)[0] * np_dtype.itemsize != nbytes:
            return None
        arr = np.frombuffer(data, dtype=np_dtype)
    else:
        shape = SHAPE_STRUCTS[ndim].unpack_from(mv, HEADER_NBYTES)
        if (ndim and min(shape) < 0) or math.prod(shape) * np_dtype.itemsize != nbytes:
            return None
        arr = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    if data.readonly or not arr.flags.aligned or not np_dtype.isnative:
        arr = arr.astype(np_dtype.newbyteorder("="))
    return arr


def decode(buf: Any, *, allow_pickle: bool = False, device: Any = None) -> Any:
    """Payload of one whole frame: bytes-like, uint8 array/tensor, or the list from :func:`encode`.

    BYTES come back as ``bytes``; arrays as numpy arrays of the sent dtype and shape; tensors as
    torch tensors on ``device`` (None: CPU; ``"same"``: the sender's device type, CPU if unknown);
    JSON as the sent value; DICT as a dict of arrays/tensors. Arrays and CPU tensors share
    ``buf``'s memory when it is writable and aligned (no copy), else they are copies. PICKLE
    frames need ``allow_pickle=True``. Raises MessageError for anything truncated, corrupt,
    foreign or not allowed.
    """
    mv = _input_view(buf)
    value = _decode_plain(mv)
    if value is not None:
        return value
    head = read_header(mv)
    data = _payload(mv, head, exact=True)
    if head.kind is Kind.BYTES:
        return bytes(data)
    if head.kind in (Kind.NDARRAY, Kind.TORCH):
        return _decode_array(head, data, device)
    if head.kind is Kind.DICT:
        return _decode_batch(head, data, device)
    if head.kind is Kind.JSON:
        try:
            return json.loads(bytes(data))
        except (ValueError, RecursionError) as e:
            raise MessageError(f"corrupt frame: unreadable JSON payload ({e})") from e
    if not allow_pickle:
        raise MessageError("received a pickled frame but allow_pickle is False; pass allow_pickle=True to decode "
                           "only if you trust the sender (unpickling runs arbitrary code)")
    try:
        return pickle.loads(data)
    except Exception as e:
        raise MessageError(f"cannot unpickle the received frame: {e}; check that both ranks run the same code") from e
