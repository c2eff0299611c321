"""The small-message fast paths give the same bytes and the same errors as the general paths."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from popmesh import MessageError, wire
from popmesh.engines.envelope import INLINE_NBYTES, inline_envelope, inline_frame, parse_envelope, plan_frame
from popmesh.engines.p2p_base import frame_parts
from popmesh.wire import SMALL_FRAME_NBYTES, decode, encode, encode_message, join_frame

SMALL = [
    b"", b"abcd", bytes(range(256)) * 16,  # 4096 bytes: the limit
    np.ones(1, np.float32), np.arange(6, dtype="<i4").reshape(2, 3), np.array(3.5), np.zeros((0, 4)),
    np.arange(12.0).reshape(3, 4)[:, ::2],  # non-contiguous: framed in C order
    np.array([True, False]), np.arange(4, dtype=np.uint64), np.ones(3, np.complex64), np.ones(2, np.float16),
]


def general(payload) -> bytes:
    return join_frame(encode(payload)).tobytes()


@pytest.mark.parametrize("payload", SMALL, ids=lambda p: f"{type(p).__name__}")
def test_small_frames_are_the_general_frames_bytes(payload):
    fast = encode_message(payload)
    assert type(fast) is bytes and fast == general(payload)
    got = decode(fast)
    if isinstance(payload, bytes):
        assert got == payload
    else:
        assert got.dtype == payload.dtype and got.shape == payload.shape and np.array_equal(got, payload)


def test_golden_frame_through_the_fast_path():
    frame = encode_message(np.arange(6, dtype="<i4").reshape(2, 3))
    assert frame.hex().startswith("504d53480202010400020000" "54582d2debab3259" "1800000000000000" "9e7a6967")


@pytest.mark.parametrize("payload", [
    bytes(SMALL_FRAME_NBYTES + 1), np.zeros(SMALL_FRAME_NBYTES // 8 + 1), np.arange(3, dtype=">i4"), bytearray(b"ab"),
    {"a": 1}, [1, 2], np.zeros(2, dtype=[("a", "<i4")]),
])
def test_other_payloads_take_the_general_path(payload):
    if isinstance(payload, np.ndarray) and payload.dtype.names:
        with pytest.raises(MessageError):
            encode_message(payload)
        return
    fast = encode_message(payload)
    assert isinstance(fast, list)
    assert join_frame(fast).tobytes() == general(payload)


def test_small_frame_is_a_copy():
    a = np.zeros(4)
    frame = encode_message(a)
    a[:] = 7
    assert decode(frame).tolist() == [0, 0, 0, 0]


def test_decoded_array_shares_a_writable_buffer_and_copies_a_readonly_one():
    frame = np.frombuffer(encode_message(np.arange(4.0)), np.uint8).copy()
    got = decode(frame)
    assert np.shares_memory(got, frame) and got.flags.writeable
    got = decode(encode_message(np.arange(4.0)))  # bytes: read-only, so a copy
    assert got.flags.writeable and got.tolist() == [0, 1, 2, 3]


def _corrupt(frame: bytes, offset: int, value: int) -> bytes:
    b = bytearray(frame)
    b[offset] = value
    return bytes(b)


def _rechecksummed(frame: bytearray) -> bytes:
    ndim = frame[9]
    struct.pack_into("<I", frame, 28, zlib.crc32(bytes(frame[32:32 + 8 * ndim]), zlib.crc32(bytes(frame[:28]))))
    return bytes(frame)


@pytest.mark.parametrize("payload", [b"abcd", np.arange(3, dtype=np.int16)])
def test_corrupt_small_frames_raise_like_the_general_path(payload):
    frame = encode_message(payload)
    bad = [
        frame[:-1], frame + b"\0", frame[:20],
        _corrupt(frame, 0, ord("X")),  # magic
        _corrupt(frame, 4, 1),  # version (1: the zlib-CRC format)
        _corrupt(frame, 12, frame[12] ^ 1),  # payload checksum (header CRC still covers it: header mismatch)
        _corrupt(frame, len(frame) - 1, frame[-1] ^ 0xFF),  # payload byte
        _corrupt(frame, 33, frame[33] ^ 1),  # shape
    ]
    hdr = bytearray(frame)
    hdr[7] = 12  # a dtype whose size does not match, with a valid header CRC
    bad.append(_rechecksummed(hdr))
    hdr = bytearray(frame)
    hdr[8] = 1  # a device code on a non-TORCH frame
    bad.append(_rechecksummed(hdr))
    hdr = bytearray(frame)
    hdr[5] = 9  # an unknown kind
    bad.append(_rechecksummed(hdr))
    for b in bad:
        with pytest.raises(MessageError):
            decode(b)
        with pytest.raises(MessageError):
            decode(np.frombuffer(b, np.uint8).copy())


def test_unchecksummed_small_frames_still_decode():
    frame = join_frame(encode(np.arange(3.0), checksum=False)).tobytes()
    assert decode(frame).tolist() == [0, 1, 2]
    frame = join_frame(encode(b"xyz", checksum=False)).tobytes()
    assert decode(frame) == b"xyz"


@pytest.mark.parametrize("nbytes", [0, 1, 40, INLINE_NBYTES])
def test_small_envelope_matches_the_general_plan(nbytes):
    data = np.arange(nbytes, dtype=np.uint8)
    fast_env, fast_segments = plan_frame([data], 5)
    general_env, general_segments = plan_frame([data[:nbytes // 2], data[nbytes // 2:]], 5)
    assert fast_segments == general_segments == []
    assert bytes(fast_env) == bytes(general_env)
    envelope = parse_envelope(np.frombuffer(fast_env, np.uint8))
    assert (envelope.tag, envelope.total, envelope.lengths) == (5, nbytes, [])
    assert envelope.inline.tobytes() == data.tobytes()


def test_corrupt_small_envelope_is_refused():
    env, _ = plan_frame([np.arange(10, dtype=np.uint8)], 0)
    bad = np.frombuffer(env, np.uint8).copy()
    struct.pack_into("<Q", bad, 8, 11)  # frame length no longer matches the inline bytes
    with pytest.raises(MessageError):
        parse_envelope(bad)


def test_frame_parts_of_a_small_frame():
    frame = encode_message(np.ones(2))
    parts = frame_parts(frame)
    assert len(parts) == 1 and parts[0].dtype == np.uint8 and join_frame(parts).tobytes() == frame


def test_read_header_kinds_are_enum_members():
    head = wire.read_header(encode_message(b"ab"))
    assert head.kind is wire.Kind.BYTES and head.shape == (2,)


def test_the_checksum_option_reaches_large_frames_and_small_ones_keep_theirs():
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: beyond the automatic limit
    assert not wire.read_header(encode_message(big)[0]).payload_checksummed
    assert wire.read_header(encode_message(big, checksum=True)[0]).payload_checksummed
    medium = {"w": np.arange(1 << 16, dtype=np.float32)}  # 256 KiB: covered unless asked not to
    assert wire.read_header(encode_message(medium)[0]).payload_checksummed
    unchecked = encode_message(medium, checksum=False)
    assert not wire.read_header(unchecked[0]).payload_checksummed
    assert np.array_equal(decode(join_frame(unchecked))["w"], medium["w"])
    assert wire.read_header(encode_message(np.ones(4), checksum=False)).payload_checksummed


def test_messages_take_the_checksum_option_in_a_world_of_one():
    import popmesh
    from popmesh.comm.messages import isend

    world = popmesh.init("local")
    try:
        payload = {"w": np.arange(1 << 16, dtype=np.float32)}
        isend(payload, 0, 3, checksum=False).wait(5)
        popmesh.send(payload, 0, 4, checksum=True)
        assert np.array_equal(popmesh.recv(0, 3, timeout=5)[1]["w"], payload["w"])
        assert np.array_equal(popmesh.recv(0, 4, timeout=5)[1]["w"], payload["w"])
    finally:
        world.finalize()


LARGE = [np.arange(1 << 12, dtype=np.float32), np.ones((3, 700, 2), np.int16), np.zeros((65, 9), np.complex128),
         np.array([True, False] * 3000).reshape(2, 3000)]


@pytest.mark.parametrize("checksum", [None, True, False])
@pytest.mark.parametrize("payload", LARGE, ids=lambda p: f"{p.dtype}{p.shape}")
def test_large_arrays_take_a_short_way_to_the_general_frame(payload, checksum):
    fast = encode_message(payload, checksum=checksum)
    assert isinstance(fast, list) and len(fast) == 2
    assert np.shares_memory(np.frombuffer(fast[1], np.uint8), payload)  # the data is not copied
    assert join_frame(fast).tobytes() == join_frame(encode(payload, checksum=checksum)).tobytes()
    got = decode(join_frame(fast))
    assert got.dtype == payload.dtype and got.shape == payload.shape and np.array_equal(got, payload)


def test_unchecksummed_large_frames_decode_in_place_and_refuse_damage():
    payload = np.arange(5000, dtype=np.float64).reshape(50, 100)
    frame = join_frame(encode(payload, checksum=False))
    got = decode(frame)
    assert np.array_equal(got, payload) and np.shares_memory(got, frame) and got.flags.writeable
    raw = frame.tobytes()
    stray_crc = bytearray(raw)
    struct.pack_into("<I", stray_crc, 12, 1234)  # a payload CRC without its flag
    unknown_flag = bytearray(raw)
    unknown_flag[6] = 2
    bad = [raw[:-8], raw + bytes(8), _corrupt(raw, 40, raw[40] ^ 1), _rechecksummed(stray_crc),
           _rechecksummed(unknown_flag)]
    for b in bad:
        with pytest.raises(MessageError):
            decode(np.frombuffer(b, np.uint8).copy())


# --- the small-message envelope paths (MPI) -----------------------------------------------------


@pytest.mark.parametrize("payload", SMALL, ids=lambda p: f"{type(p).__name__}")
def test_inline_envelope_is_plan_frames_envelope_and_inline_frame_reads_it_back(payload):
    frame = encode_message(payload)
    fast = inline_envelope(frame, 9)
    planned, segments = plan_frame([np.frombuffer(frame, np.uint8)], 9)
    assert not segments and fast == bytes(planned)
    env = np.frombuffer(fast, np.uint8).copy()
    assert inline_frame(env, 9).tobytes() == frame == parse_envelope(env).inline.tobytes()


def test_inline_frame_leaves_anything_unusual_to_parse_envelope():
    env = np.frombuffer(inline_envelope(encode_message(b"abcd"), 9), np.uint8).copy()
    assert inline_frame(env, 8) is None  # another tag
    assert inline_frame(env[:-1], 9) is None and inline_frame(env[:10], 9) is None  # truncated
    assert inline_frame(np.concatenate([env, np.zeros(1, np.uint8)]), 9) is None  # padded
    for offset, value in ((0, ord("X")), (4, 2), (6, 1)):  # magic, version, a segment count
        bad = env.copy()
        bad[offset] = value
        assert inline_frame(bad, 9) is None
        with pytest.raises(MessageError):
            parse_envelope(bad)
    segmented, segments = plan_frame([np.ones(INLINE_NBYTES + 1, np.uint8)], 9)
    assert segments and inline_frame(np.frombuffer(bytes(segmented), np.uint8), 9) is None


def test_mpi_relies_on_mpi_for_payloads_and_gloo_checks_them():
    from popmesh.engines.mpi.p2p import MpiP2P
    from popmesh.engines.p2p_base import P2PBase

    assert MpiP2P.payload_checksum is False and P2PBase.payload_checksum is None
    medium = np.ones(SMALL_FRAME_NBYTES + 8, np.uint8)
    assert not wire.read_header(encode_message(medium, checksum=MpiP2P.payload_checksum)[0]).payload_checksummed
    assert wire.read_header(encode_message(medium, checksum=P2PBase.payload_checksum)[0]).payload_checksummed
