"""Every fast path against its slow path, on generated inputs: the wire's one-pass framing and plain
decoding, and fused collectives' flatten/split. (The collectives' single-array path is checked on real
worlds: ``fast_paths_equal_the_tree_paths`` in tests/world/workers/collectives_worker.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from popmesh import MessageError
from popmesh.comm.fusion import apply_fused, fresh_copy
from popmesh.wire import SMALL_FRAME_NBYTES, decode, decoding, encode, encode_message, join_frame

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"]


@st.composite
def arrays(draw, max_nbytes=3 * SMALL_FRAME_NBYTES):
    """numpy arrays of every framed dtype, 0 to 4 dimensions, either byte order, possibly strided,
    from empty to a few times the small-frame limit (both sides of it)."""
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    if dtype.itemsize > 1 and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")
    ndim = draw(st.integers(0, 4))
    limit = max(1, max_nbytes // dtype.itemsize)
    shape = tuple(draw(st.lists(st.integers(0, 12 if ndim > 1 else limit), min_size=ndim, max_size=ndim)))
    count = int(np.prod(shape, dtype=np.int64))
    if count > limit:
        shape, count = (limit,), limit
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if a.ndim and a.shape[-1] > 1 and draw(st.booleans()):
        a = a[..., ::2]  # not contiguous
    return a


def _same_array(got, want) -> None:
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # bit for bit: NaN payloads and -0.0 too


def _full_path(monkeypatch, frame, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(decoding, "_decode_plain", lambda mv: None)
        return decode(frame, **kwargs)


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(a=arrays(), checksum=st.sampled_from([None, True, False]))
def test_encode_message_gives_the_frame_of_encode(a, checksum):
    fast = encode_message(a, checksum=checksum)
    small = type(fast) is bytes  # one-pass frames keep their payload checksum whatever was asked
    assert small == (a.dtype.isnative and a.nbytes <= SMALL_FRAME_NBYTES)
    slow = join_frame(encode(a, checksum=True if small else checksum)).tobytes()
    assert (fast if small else join_frame(fast).tobytes()) == slow


@_SETTINGS
@given(a=arrays(), checksum=st.sampled_from([None, True, False]), readonly=st.booleans())
def test_plain_decoding_returns_what_the_full_path_returns(monkeypatch, a, checksum, readonly):
    frame = join_frame(encode(a, checksum=checksum))
    frame = frame.tobytes() if readonly else frame
    want = a.astype(a.dtype.newbyteorder("="))
    fast, full = decode(frame), _full_path(monkeypatch, frame)
    _same_array(fast, want)
    _same_array(full, want)
    assert fast.flags.writeable and full.flags.writeable
    if not readonly:  # both share a writable, aligned frame (no copy), or neither does
        assert np.shares_memory(fast, frame) == np.shares_memory(full, frame)


@_SETTINGS
@given(data=st.one_of(st.binary(max_size=3 * SMALL_FRAME_NBYTES), arrays(max_nbytes=256)),
       checksum=st.sampled_from([None, True, False]), at=st.integers(0, 10_000), value=st.integers(0, 255))
def test_damaged_frames_fail_or_decode_alike_on_both_paths(monkeypatch, data, checksum, at, value):
    """A damaged byte anywhere: the fast path never accepts what the full path refuses, and never
    refuses (or decodes differently) what the full path accepts."""
    frame = bytearray(join_frame(encode(data, checksum=checksum)).tobytes())
    frame[at % len(frame)] = value
    outcomes = []
    for decoder in (lambda f: decode(f), lambda f: _full_path(monkeypatch, f)):
        try:
            got = decoder(bytes(frame))
        except MessageError:
            outcomes.append("MessageError")
        else:
            outcomes.append(got if isinstance(got, bytes) else (got.dtype.str, got.shape, got.tobytes()))
    assert outcomes[0] == outcomes[1]


# ---- fusion: one engine call per (kind, dtype, device) against one call per leaf ------------------------
def _leaves() -> list:
    """Distinct values per leaf (so a piece split back into the wrong leaf shows), mixed kinds and dtypes,
    strided, 0-d and empty ones."""
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    return [
        np.arange(5, dtype=np.float32), strided, np.array(7.5, dtype=np.float32), np.zeros((0, 3), np.float32),
        np.arange(6, dtype=np.float64).reshape(2, 3) - 2.5, np.arange(4, dtype=np.int64) * 11,
        np.array([True, False, True]), np.array([False]), np.arange(3, dtype=np.float16) + 0.5,
        torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.arange(8, dtype=torch.float32).reshape(2, 4).T,
        torch.tensor(-3.0), torch.arange(5, dtype=torch.bfloat16), torch.arange(4, dtype=torch.int32) - 2,
        torch.tensor([True, False]), np.arange(3, dtype=np.float32) + 100,
    ]


def _elementwise(buf) -> None:
    """What an element-wise engine op does to a buffer, in place (booleans: not)."""
    if isinstance(buf, torch.Tensor):
        buf.logical_not_() if buf.dtype == torch.bool else buf.mul_(3).sub_(1)
    elif buf.dtype == np.bool_:
        np.logical_not(buf, out=buf)
    else:
        buf *= 3
        buf -= 1


def _per_leaf(leaves: list) -> list:
    out = []
    for leaf in leaves:
        copy = fresh_copy(leaf)
        _elementwise(copy)
        out.append(copy)
    return out


def _assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    else:
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)


@pytest.mark.parametrize("in_place", [False, True])
def test_fused_groups_give_the_per_leaf_results(in_place):
    leaves = _leaves()
    before = [fresh_copy(leaf) for leaf in leaves]
    want = _per_leaf(leaves)
    calls = []
    results = apply_fused(leaves, lambda buf: (calls.append(1), _elementwise(buf)), in_place=in_place)
    assert len(calls) == 9 < len(leaves)  # numpy f32/f64/i64/bool/f16 and torch f32/bf16/i32/bool: fused
    for got, expected, leaf, old in zip(results, want, leaves, before):
        _assert_same(got, expected)
        _assert_same(leaf, expected if in_place else old)  # in place: written back; else untouched


@_SETTINGS
@given(picks=st.lists(st.integers(0, 15), min_size=1, max_size=12), in_place=st.booleans())
def test_any_mix_of_leaves_fuses_like_per_leaf(picks, in_place):
    pool = _leaves()
    leaves = [fresh_copy(pool[i]) for i in picks]  # repeats are distinct buffers with equal values
    want = _per_leaf(leaves)
    results = apply_fused(leaves, _elementwise, in_place=in_place)
    for got, expected in zip(results, want):
        _assert_same(got, expected)
    if in_place:
        for leaf, expected in zip(leaves, want):
            _assert_same(leaf, expected)

