"""Wire format: round trips of every kind and dtype, stable bytes, and MessageError on damage."""

from __future__ import annotations

import inspect
import math
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from popmesh import wire
from popmesh.core.errors import MessageError
from popmesh.wire import CHECKSUM_AUTO_LIMIT, DTYPE_CODES, Kind, decode, encode, encode_message, join_frame, read_header
from popmesh.wire import encoding as wire_encode

try:
    import torch
except ImportError:  # the wire format works without torch; only the tensor tests need it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

NUMPY_DTYPES = [name for name in DTYPE_CODES if name != "bfloat16"]
TORCH_DTYPES = list(DTYPE_CODES)
SHAPES = [(), (0,), (5,), (2, 0, 3), (2, 3, 4)]


def frame_bytes(payload, **kwargs) -> bytes:
    return join_frame(encode(payload, **kwargs)).tobytes()


def recrc(frame: bytes) -> bytes:
    """Recompute the header CRC so a deliberately edited header reaches the later checks."""
    ndim = frame[9]
    head = frame[:28] + frame[32:32 + 8 * ndim]
    return frame[:28] + struct.pack("<I", zlib.crc32(head)) + frame[32:]


def patch(frame: bytes, offset: int, fmt: str, value) -> bytes:
    edited = bytearray(frame)
    struct.pack_into(fmt, edited, offset, value)
    return recrc(bytes(edited))


def sample_array(name: str, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    raw = np.arange(1, n + 1, dtype=np.int64) * 37 - 11
    if name == "bool":
        return (raw % 3 == 0).reshape(shape)
    if name.startswith("complex"):
        return (raw + 0.5j * raw).astype(name).reshape(shape)
    return raw.astype(name).reshape(shape)


def assert_same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def assert_same_tensor(got, want) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu"
    assert tensor_bytes(got) == tensor_bytes(want)


def tensor_bytes(t) -> bytes:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"abc", bytes(range(256)), bytearray(b"xyz"), memoryview(b"hello")])
def test_bytes_round_trip(payload):
    got = decode(encode(payload))
    assert type(got) is bytes and got == bytes(payload)


def test_non_contiguous_memoryview_sends_its_bytes():
    view = memoryview(np.arange(10, dtype=np.uint8))[::2]
    assert decode(encode(view)) == bytes([0, 2, 4, 6, 8])


@pytest.mark.parametrize("name", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_round_trip_every_dtype_and_shape(name, shape):
    arr = sample_array(name, shape)
    assert_same_array(decode(encode(arr)), arr)


@pytest.mark.parametrize("make", [
    lambda a: a[::2], lambda a: a.T, lambda a: np.asfortranarray(a), lambda a: a[:, ::-1],
])
def test_numpy_non_contiguous_inputs(make):
    view = make(np.arange(24, dtype=np.float32).reshape(4, 6))
    assert_same_array(decode(encode(view)), view)


def test_big_endian_input_arrives_with_the_same_values():
    arr = np.arange(6, dtype=">i4")
    got = decode(encode(arr))
    assert got.dtype == np.dtype("<i4") and got.tolist() == arr.tolist()
    assert frame_bytes(arr) == frame_bytes(arr.astype("<i4"))


def test_numpy_bfloat16_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arr = np.array([1.5, -2.0, np.inf, 0.0], dtype=ml_dtypes.bfloat16)
    got = decode(encode(arr))
    assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()


@needs_torch
@pytest.mark.parametrize("name", TORCH_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_round_trip_every_dtype_and_shape(name, shape):
    t = torch.from_numpy(sample_array("float32" if name == "bfloat16" else name, shape))
    t = t.to(torch.bfloat16) if name == "bfloat16" else t
    assert_same_tensor(decode(encode(t)), t)


@needs_torch
def test_torch_reinterprets_bytes_never_value_casts():
    bits = torch.tensor([0x7FC00001, 0x3FC00000, -1, 0x80000000 - 1], dtype=torch.int32)
    t = bits.view(torch.float32)  # a NaN payload, 1.5, a NaN, a NaN: only bytes survive a round trip
    assert torch.equal(decode(encode(t)).view(torch.int32), bits)
    bf = torch.tensor([0x7FC1, 0x3FC0, -32768, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    assert torch.equal(decode(encode(bf)).view(torch.int16), bf.view(torch.int16))


@needs_torch
def test_torch_special_tensors():
    grad = torch.arange(4.0, requires_grad=True) * 2
    assert_same_tensor(decode(encode(grad)), grad.detach())
    strided = torch.arange(12).reshape(3, 4).t()
    assert_same_tensor(decode(encode(strided)), strided)
    conj = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert torch.equal(decode(encode(conj)), conj.resolve_conj())
    param = torch.nn.Parameter(torch.ones(2))
    got = decode(encode(param))
    assert type(got) is torch.Tensor and torch.equal(got, torch.ones(2))


@needs_torch
def test_torch_and_numpy_payload_bytes_are_identical():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    from_numpy, from_torch = frame_bytes(arr), frame_bytes(torch.from_numpy(arr))
    assert from_numpy[48:] == from_torch[48:]  # same payload bytes after the 2-d header
    differ = [i for i in range(48) if from_numpy[i] != from_torch[i]]
    assert differ[0] == 5 and all(28 <= i < 32 for i in differ[1:])  # only the kind byte and the header CRC
    assert read_header(from_numpy).kind is Kind.NDARRAY and read_header(from_torch).kind is Kind.TORCH


JSON_VALUES = [
    None, True, 0, -(2**80), 3.25, "", "naïve \U0001f600 \ud800", [], {}, [1, [2, [3]]],
    {"a": {"b": [None, 1.5, "x"]}, "": False},
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_round_trip(value):
    got = decode(encode(value))
    assert got == value and type(got) is type(value)


def test_json_non_finite_floats():
    got = decode(encode([math.inf, -math.inf, math.nan]))
    assert got[:2] == [math.inf, -math.inf] and math.isnan(got[2])


@needs_torch
def test_batch_of_arrays_and_tensors():
    batch = {
        "obs": np.arange(12, dtype=np.float32).reshape(3, 4),
        "done": np.array([True, False, True]),
        "logp": torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16),
        "empty": np.zeros((0, 7), dtype=np.int16),
        "scalar": np.array(3.5),
    }
    parts = encode(batch)
    assert read_header(parts[0]).kind is Kind.DICT
    got = decode(parts)
    assert list(got) == list(batch)
    for key, value in batch.items():
        (assert_same_tensor if isinstance(value, torch.Tensor) else assert_same_array)(got[key], value)


def test_empty_dict_is_an_empty_batch():
    assert decode(encode({})) == {}
    assert read_header(encode({})[0]).kind is Kind.DICT


def test_mixed_dict_is_json_or_needs_pickle():
    assert read_header(encode({"a": 1})[0]).kind is Kind.JSON
    mixed = {"a": np.zeros(2), "b": 1}
    with pytest.raises(MessageError, match="allow_pickle=True"):
        encode(mixed)
    got = decode(encode(mixed, allow_pickle=True), allow_pickle=True)
    assert got["b"] == 1 and np.array_equal(got["a"], np.zeros(2))


def test_jax_arrays_arrive_as_numpy():
    jnp = pytest.importorskip("jax.numpy")
    got = decode(encode(jnp.arange(4, dtype=jnp.int32)))
    assert_same_array(got, np.arange(4, dtype=np.int32))


# --- pickle opt-in on both ends ------------------------------------------------------------------


NEEDS_PICKLE = [(1, 2), {1: "a"}, {1.5}, np.float64(2.0), object, b"x".decode, np.array([object()]), {1: np.ones(2)}]
NEEDS_PICKLE += [torch.Size([2, 3]), torch.float32] if torch is not None else []


@pytest.mark.parametrize("value", NEEDS_PICKLE)
def test_sender_refuses_what_needs_pickle(value):
    with pytest.raises(MessageError, match="allow_pickle=True"):
        encode(value)


@pytest.mark.parametrize(("value", "where"), [
    ({"a": {"b": object()}}, 'payload["a"]["b"] is an object'),
    ({"cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}, 'payload["cfg"]["betas"] is a tuple'),
    ([1, [2, {"k": np.float32(1)}]], 'payload[1][1]["k"] is a float32'),
    ({"a": {2: "x"}}, 'payload["a"] has the key 2, an int (keys must be str)'),
    ({1: "x"}, "payload has the key 1, an int"),
    ({"states": np.zeros(2), "step": 3}, 'payload["step"] is an int in a dict of arrays'),
    ({"states": np.zeros(2), "o": np.array([object()])}, 'payload["o"] is a ndarray of dtype object'),
])
def test_refusal_names_the_path_of_the_nested_value(value, where):
    for encoder in (encode, encode_message):
        with pytest.raises(MessageError, match=re.escape(where) + ".*allow_pickle=True"):
            encoder(value)


def test_pickle_needs_opt_in_on_receiver_too():
    parts = encode((1, "two", np.float32(3)), allow_pickle=True)
    assert read_header(parts[0]).kind is Kind.PICKLE
    with pytest.raises(MessageError, match="allow_pickle is False"):
        decode(parts)
    assert decode(parts, allow_pickle=True) == (1, "two", np.float32(3))


def test_unpicklable_object_raises_message_error():
    with pytest.raises(MessageError, match="cannot pickle"):
        encode(lambda: 1, allow_pickle=True)


def test_unpickling_failure_raises_message_error():
    bogus = wire_encode._frame(Kind.PICKLE, 0, 0, (), [b"\x80\x05not a pickle"], True)
    with pytest.raises(MessageError, match="cannot unpickle"):
        decode(bogus, allow_pickle=True)


# --- device handling -----------------------------------------------------------------------------


@needs_torch
def test_device_argument_and_same():
    t = torch.arange(3.0)
    assert decode(encode(t), device="cpu").device.type == "cpu"
    assert decode(encode(t), device=torch.device("cpu")).device.type == "cpu"
    assert decode(encode(t), device="same").device.type == "cpu"
    assert read_header(encode(t)[0]).device == "cpu"


@needs_torch
def test_same_restores_a_cuda_senders_device_type():
    cuda_frame = patch(frame_bytes(torch.arange(3.0)), 8, "<B", 1)
    assert read_header(cuda_frame).device == "cuda"
    assert decode(cuda_frame).device.type == "cpu"  # default: CPU
    if torch.cuda.is_available():
        assert decode(cuda_frame, device="same").device.type == "cuda"
    else:
        with pytest.raises(MessageError, match="cannot place the received tensor on device 'cuda'"):
            decode(cuda_frame, device="same")


def test_device_on_non_tensor_frames_is_ignored():
    assert_same_array(decode(encode(np.ones(2)), device="same"), np.ones(2))


def test_torch_frame_without_torch_installed(monkeypatch):
    frame = patch(frame_bytes(np.arange(3.0)), 5, "<B", int(Kind.TORCH))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MessageError, match="torch is not installed"):
        decode(frame)


@needs_torch
def test_meta_tensor_cannot_be_sent():
    with pytest.raises(MessageError, match="without pickle"):
        encode(torch.empty(3, device="meta"))


# --- buffers: zero copy, accepted inputs, aliasing ---------------------------------------------


@needs_torch
def test_encode_is_zero_copy_for_contiguous_arrays():
    arr = np.arange(1000, dtype=np.float64)
    parts = encode(arr)
    assert len(parts) == 2 and np.shares_memory(np.frombuffer(parts[1], dtype=np.uint8), arr)
    t = torch.arange(100, dtype=torch.float32)
    assert np.shares_memory(np.frombuffer(encode(t)[1], dtype=np.uint8), t.numpy())


@needs_torch
@pytest.mark.parametrize("convert", [
    bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8).copy(),
    lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
])
def test_decode_accepts_every_buffer_type(convert):
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert_same_array(decode(convert(frame_bytes(arr))), arr)


@needs_torch
def test_decoded_arrays_view_writable_buffers_and_copy_read_only_ones():
    buf = bytearray(frame_bytes(np.arange(4, dtype=np.int32)))
    view = decode(buf)
    assert np.shares_memory(view, np.frombuffer(buf, dtype=np.uint8))
    copy = decode(bytes(buf))
    assert copy.flags.writeable
    copy[0] = 99
    assert decode(bytes(buf))[0] == 0
    tensor = decode(bytes(frame_bytes(torch.arange(3))))
    tensor += 1  # a writable tensor, no warning about non-writable numpy arrays


@needs_torch
def test_misaligned_buffers_give_aligned_copies():
    frame = frame_bytes({"z": torch.arange(5.0).to(torch.complex128), "x": np.arange(5.0)})
    raw = np.empty(len(frame) + 1, np.uint8)[1:]
    raw[:] = np.frombuffer(frame, np.uint8)
    got = decode(raw)
    assert got["x"].flags.aligned and got["z"].data_ptr() % 16 == 0
    assert got["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and got["z"].real.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@needs_torch
def test_frame_nbytes_matches_join():
    parts = encode({"a": np.ones(3), "b": torch.zeros(2, 2)})
    assert wire.frame_nbytes(parts) == len(join_frame(parts)) == read_header(parts[0]).frame_nbytes


# --- stable, engine-independent bytes -----------------------------------------------------------


def test_golden_header_is_stable():
    arr = np.arange(6, dtype="<i4").reshape(2, 3)
    frame = frame_bytes(arr)
    assert frame.hex() == (
        "504d5348" "02" "02" "01" "04" "00" "02" "0000"  # magic, version 2, NDARRAY, checksummed, int32, cpu, ndim 2
        "54582d2debab3259"  # payload XXH3-64
        "1800000000000000"  # payload length 24
        "9e7a6967"  # header CRC32
        "0200000000000000" "0300000000000000"  # shape (2, 3)
        "000000000100000002000000030000000400000005000000"  # payload
    )
    assert struct.unpack_from("<Q", frame, 12)[0] == xxhash.xxh3_64_intdigest(arr.tobytes())
    assert struct.unpack_from("<I", frame, 28)[0] == zlib.crc32(frame[:28] + frame[32:48])


@needs_torch
def test_encoding_is_a_pure_function_of_the_payload():
    assert "engine" not in inspect.signature(encode).parameters
    batch = {"x": np.arange(5.0), "y": torch.ones(2, dtype=torch.int64)}
    assert frame_bytes(batch) == frame_bytes(batch)
    assert frame_bytes(np.arange(6.0).reshape(2, 3)) == frame_bytes(np.asfortranarray(np.arange(6.0).reshape(2, 3)))
    joined = join_frame(encode(batch)).tobytes()
    assert joined == b"".join(bytes(p) for p in encode(batch))


def test_importing_wire_does_not_import_torch():
    code = "import sys, numpy, popmesh.wire as w; w.decode(w.encode(numpy.ones(2))); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- checksum flag ----------------------------------------------------------------------------


def test_checksum_flag_modes():
    small, large = np.ones(8, np.uint8), np.ones(CHECKSUM_AUTO_LIMIT + 8, np.uint8)
    assert read_header(encode(small)[0]).payload_checksummed
    assert not read_header(encode(large)[0]).payload_checksummed
    assert read_header(encode(large, checksum=True)[0]).payload_checksummed
    unchecked = read_header(encode(small, checksum=False)[0])
    assert not unchecked.payload_checksummed and unchecked.payload_checksum == 0
    assert_same_array(decode(encode(large, checksum=True)), large)


def test_header_is_checked_even_without_payload_checksum():
    frame = frame_bytes(np.arange(4.0), checksum=False)
    for bit in range(40 * 8):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(MessageError):
            decode(bytes(damaged))


# --- damage: truncation, flips, foreign frames -------------------------------------------------------


DAMAGE_PAYLOADS = [b"abc", np.arange(3, dtype=np.int16), {"k": [1, None]}, {"a": np.ones(2, np.uint8)}, {}]
DAMAGE_PAYLOADS += [torch.tensor([1.5], dtype=torch.bfloat16), {"t": torch.zeros(1)}] if torch is not None else []


@pytest.mark.parametrize("payload", DAMAGE_PAYLOADS, ids=lambda p: type(p).__name__)
def test_every_truncation_and_extension_raises(payload):
    frame = frame_bytes(payload)
    for cut in range(len(frame)):
        with pytest.raises(MessageError):
            decode(frame[:cut])
    with pytest.raises(MessageError, match="overlong"):
        decode(frame + b"\x00")


@pytest.mark.parametrize("payload", DAMAGE_PAYLOADS, ids=lambda p: type(p).__name__)
def test_every_single_bit_flip_raises(payload):
    frame = frame_bytes(payload)
    for bit in range(len(frame) * 8):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(MessageError):
            decode(bytes(damaged), allow_pickle=True)


@pytest.mark.parametrize("offset,fmt,value,match", [
    (0, "<4s", b"HTTP", "not a popmesh frame"),
    (4, "<B", 1, "version 1 is not supported"),  # version 1 had a zlib CRC32 where the XXH3-64 sits now
    (4, "<B", 3, "version 3 is not supported"),
    (5, "<B", 9, "kind 9"),
    (6, "<B", 3, "flags 0x3"),
    (7, "<B", 99, "unknown dtype code 99"),
    (7, "<B", 12, "needs 48 bytes but the header says 24"),
    (8, "<B", 1, "device code 1 for a NDARRAY"),
    (10, "<H", 1, "reserved"),
    (12, "<Q", 5, "payload checksum mismatch"),
    (20, "<Q", 2**62, "needs 24 bytes but the header says"),
    (32, "<q", -2, "negative shape"),
    (40, "<q", 4, "needs 32 bytes"),
])
def test_foreign_or_inconsistent_headers(offset, fmt, value, match):
    frame = frame_bytes(np.arange(6, dtype=np.int32).reshape(2, 3))
    with pytest.raises(MessageError, match=match):
        decode(patch(frame, offset, fmt, value))


def test_header_checksum_mismatch_message():
    frame = bytearray(frame_bytes(np.arange(3)))
    frame[7] ^= 0x01
    with pytest.raises(MessageError, match="header checksum mismatch"):
        decode(bytes(frame))


def test_payload_checksum_mismatch_message():
    frame = bytearray(frame_bytes(np.arange(3)))
    frame[-1] ^= 0x80
    with pytest.raises(MessageError, match="payload checksum mismatch"):
        decode(bytes(frame))


@pytest.mark.parametrize("index,match", [
    (b'{"keys":["a","b"]}', "truncated"),
    (b'{"keys":["a","a"]}', "distinct string keys"),
    (b'{"nokeys":[]}', "distinct string keys"),
    (b'[1,2]', "distinct string keys"),
    (b'{"keys":[', "unreadable DICT index"),
])
def test_malformed_batch_index(index, match):
    frame = frame_bytes({"abcd": np.ones(2)}, checksum=False)
    assert frame[40:57] == b'{"keys":["abcd"]}'
    edited = frame[:40] + index.ljust(24) + frame[64:]
    with pytest.raises(MessageError, match=match):
        decode(edited)


def test_batch_entry_must_be_an_array_frame():
    inner = join_frame(encode(b"12345678", checksum=False)).tobytes()
    index = b'{"keys":["a"]}'.ljust(16)
    bogus = join_frame(wire_encode._frame(Kind.DICT, 0, 0, (16,), [index, inner], True)).tobytes()
    with pytest.raises(MessageError, match="is a BYTES frame, not an array"):
        decode(bogus)


@pytest.mark.parametrize("junk", ["a string", 12, None, [1, 2], object()])
def test_decode_rejects_non_buffers(junk):
    with pytest.raises(MessageError):
        decode(junk)


# --- properties --------------------------------------------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
arrays = hnp.arrays(dtype=st.sampled_from(NUMPY_DTYPES).map(np.dtype),
                    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
payloads = st.one_of(st.binary(max_size=64), arrays, json_values,
                     st.dictionaries(st.text(max_size=4), arrays, max_size=3))


def same(got, want) -> bool:
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    if isinstance(want, dict) and want and all(isinstance(v, np.ndarray) for v in want.values()):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    return got == want


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=payloads)
def test_round_trip_property(payload):
    assert same(decode(encode(payload)), payload)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=payloads, data=st.data())
def test_damage_property(payload, data):
    frame = frame_bytes(payload, checksum=True)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(MessageError):
        decode(frame[:cut])
    flips = data.draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=3, unique=True))
    damaged = bytearray(frame)
    for bit in flips:
        damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(MessageError):
        decode(bytes(damaged), allow_pickle=True)


@settings(max_examples=300, deadline=None)
@given(junk=st.binary(max_size=200) | st.binary(max_size=100).map(lambda b: wire.MAGIC + b"\x01" + b))
def test_random_bytes_raise_message_error(junk):
    with pytest.raises(MessageError):
        decode(junk, allow_pickle=True)
