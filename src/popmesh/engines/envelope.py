"""The transport envelope shared by the gloo and MPI point-to-point engines (pure functions).

A frame travels as one fixed :data:`ENVELOPE_NBYTES`-byte *envelope* followed by zero or more
*payload segments* on a sibling tag. The envelope holds the frame length, the segment lengths and
the frame's first bytes inline, so a frame of at most :data:`INLINE_NBYTES` bytes is the envelope
alone, and the receiver knows every size before it receives (gloo needs that). Buffers of 64 KiB or
more are sent as their own segments, straight from the caller's memory (no copy, and no derived
datatype, which MPICH packs). Layout, little-endian: magic ``b"PMTE"``, u16 version, u16 segment
count, u64 frame length, u32 inline length, u32 reserved (zero), 16 x u64 segment lengths, inline
bytes.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import MessageError
from .p2p_base import join_parts

__all__ = ["ENVELOPE_NBYTES", "INLINE_NBYTES", "MAX_SEGMENTS", "plan_frame", "parse_envelope"]

ENVELOPE_NBYTES = 512
MAX_SEGMENTS = 16
_HEAD = struct.Struct("<4sHHQII")  # magic, version, segment count, frame length, inline length, reserved
_SEGMENTS_AT = _HEAD.size
_INLINE_AT = _SEGMENTS_AT + 8 * MAX_SEGMENTS
INLINE_NBYTES = ENVELOPE_NBYTES - _INLINE_AT
_MAGIC, _VERSION = b"PMTE", 1
_ZERO_COPY_MIN = 1 << 16


def plan_frame(parts: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The envelope and payload segments that carry ``parts`` (flat uint8 arrays) as one frame.

    Leading parts that fit go inline; parts of 64 KiB or more become their own segment (no copy);
    runs of smaller parts are joined into one segment; at most :data:`MAX_SEGMENTS` segments.
    """
    if len(parts) == 1 and parts[0].size <= INLINE_NBYTES:  # the common small frame: the envelope alone
        part = parts[0]
        env = np.zeros(ENVELOPE_NBYTES, dtype=np.uint8)
        _HEAD.pack_into(env, 0, _MAGIC, _VERSION, 0, part.size, part.size, 0)
        env[_INLINE_AT:_INLINE_AT + part.size] = part
        return env, []
    total = sum(p.size for p in parts)
    count = len(parts)
    if total > INLINE_NBYTES:
        count, used = 0, 0
        while count < len(parts) and used + parts[count].size <= INLINE_NBYTES:
            used += parts[count].size
            count += 1
    segments = _segments(parts[count:])
    env = np.zeros(ENVELOPE_NBYTES, dtype=np.uint8)
    pos = _INLINE_AT
    for part in parts[:count]:
        env[pos:pos + part.size] = part
        pos += part.size
    _HEAD.pack_into(env, 0, _MAGIC, _VERSION, len(segments), total, pos - _INLINE_AT, 0)
    if segments:
        struct.pack_into(f"<{len(segments)}Q", env, _SEGMENTS_AT, *(s.size for s in segments))
    return env, segments


def _segments(parts: list[np.ndarray]) -> list[np.ndarray]:
    segments: list[np.ndarray] = []
    run: list[np.ndarray] = []
    for p in parts:
        if p.size >= _ZERO_COPY_MIN:
            if run:
                segments.append(join_parts(run))
                run = []
            segments.append(p)
        elif p.size:
            run.append(p)
    if run:
        segments.append(join_parts(run))
    if len(segments) > MAX_SEGMENTS:
        segments = segments[:MAX_SEGMENTS - 1] + [join_parts(segments[MAX_SEGMENTS - 1:])]
    return segments


def parse_envelope(env: np.ndarray) -> tuple[int, np.ndarray, list[int]]:
    """``(frame length, inline bytes (a view), segment lengths)``; MessageError if ``env`` is not one."""
    if env.size != ENVELOPE_NBYTES:
        raise MessageError(f"an envelope has {ENVELOPE_NBYTES} bytes, got {env.size}")
    magic, version, nseg, total, inline, reserved = _HEAD.unpack_from(env)
    if magic != _MAGIC or version != _VERSION or reserved:
        raise MessageError(f"not a popmesh envelope (magic {bytes(magic)!r}, version {version}): another program "
                           "sent on popmesh's internal gloo tags, or the ranks run different popmesh versions")
    if nseg > MAX_SEGMENTS or inline > INLINE_NBYTES:
        raise MessageError(f"corrupt envelope: {nseg} segments, {inline} inline bytes")
    if not nseg and inline == total:  # the common small frame: nothing beyond the inline bytes
        return total, env[_INLINE_AT:_INLINE_AT + inline], []
    lengths = list(struct.unpack_from(f"<{nseg}Q", env, _SEGMENTS_AT))
    if any(n == 0 for n in lengths) or inline + sum(lengths) != total:
        raise MessageError(f"corrupt envelope: {inline} inline bytes and segments {lengths} do not add up to {total}")
    return total, env[_INLINE_AT:_INLINE_AT + inline], lengths
