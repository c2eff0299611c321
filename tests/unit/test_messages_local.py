"""Messages without processes: a world of one (loopback), the gloo envelope, tags, and bad frames."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popmesh
from popmesh import CommTimeout, ConfigError, MessageError
from popmesh.comm import messages as m
from popmesh.engines.envelope import (
    ENVELOPE_MAX_NBYTES,
    GOODBYE_TAG,
    HEADER_NBYTES,
    INLINE_NBYTES,
    MAX_SEGMENTS,
    PAGE_NBYTES,
    goodbye_envelope,
    parse_envelope,
    plan_frame,
)
from popmesh.engines.p2p_base import BufferPool, LoopbackP2P, P2PBase, frame_parts
from popmesh.wire import encode, join_frame


@pytest.fixture(scope="module")
def world():
    w = popmesh.init("local")
    yield w


def test_world_of_one_sends_to_itself(world):
    m.send({"a": np.arange(3)}, 0, tag=1)
    m.send(b"two", 0, tag=1)
    src, batch = m.recv(0, tag=1)
    assert src == 0 and batch["a"].tolist() == [0, 1, 2]
    assert m.recv(None, tag=1) == (0, b"two")


def test_a_sent_array_is_a_copy(world):
    a = np.zeros(4)
    m.send(a, 0, tag=2)
    a[:] = 7
    assert m.recv(0, tag=2)[1].tolist() == [0, 0, 0, 0]


def test_receive_timeout_then_late_message(world):
    start = time.monotonic()
    with pytest.raises(CommTimeout, match="not lost"):
        m.recv(0, tag=3, timeout=0.2)
    assert time.monotonic() - start < 2
    m.send("late", 0, tag=3)
    assert m.recv(0, tag=3, timeout=1) == (0, "late")


def test_irecv_posting_order_and_withdraw_on_drop(world):
    first, second = m.irecv(0, tag=4), m.irecv(0, tag=4)
    dropped = m.irecv(0, tag=5)
    del dropped  # a dropped handle withdraws: it must not swallow the next message
    m.send("a", 0, tag=4)
    m.send("b", 0, tag=4)
    m.send("c", 0, tag=5)
    assert second.wait(1) == (0, "b") and first.done() and first.wait() == (0, "a")
    assert m.recv(0, tag=5, timeout=1) == (0, "c")


def test_timed_out_irecv_stays_posted(world):
    h = m.irecv(0, tag=6)
    with pytest.raises(CommTimeout):
        h.wait(0.05)
    m.send(5, 0, tag=6)
    assert h.wait(1) == (0, 5)


def test_isend_handle(world):
    h = m.isend(np.ones(3), 0, tag=7)
    assert h.done()
    h.wait()
    assert m.recv(0, 7)[1].tolist() == [1, 1, 1]


@pytest.mark.parametrize("tag", [m.INTERNAL_TAG_BASE, m.TAG_LIMIT - 1, -1, m.TAG_LIMIT, 2.0, True, "1"])
def test_bad_and_reserved_tags(world, tag):
    with pytest.raises(ConfigError):
        m.send(1, 0, tag)
    with pytest.raises(ConfigError):
        m.irecv(0, tag)


def test_internal_tags_are_accepted_and_bounded(world):
    tag = m.internal_tag(5)
    assert tag == m.INTERNAL_TAG_BASE + 5 and tag in m.BUFFERS_TAGS
    m.send("svc", 0, tag)
    assert m.recv(0, tag) == (0, "svc")
    with pytest.raises(ConfigError):
        m.internal_tag(1024)


def test_bad_ranks_and_timeouts(world):
    for dst in (1, -1, None, "0"):
        with pytest.raises(ConfigError):
            m.send(1, dst)
    with pytest.raises(ConfigError):
        m.recv(0, timeout=0)
    with pytest.raises(MessageError):
        m.send(object(), 0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_received_give_a_frame_error_or_a_payload(world, garbage):
    world.engine.p2p().send(garbage, 0, 8, 1.0)
    try:
        m.recv(0, 8, timeout=1)
    except m.FrameError as e:
        assert e.src == 0 and e.tag == 8
    m.send("next", 0, 8)
    assert m.recv(0, 8, timeout=1) == (0, "next")  # the receiver keeps working


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 40), st.integers(0, 3))
def test_mutated_frames_never_crash_the_receiver(world, position, flips):
    frame = join_frame(encode({"x": np.arange(5.0)}))
    for i in range(flips):
        frame[(position * 7 + i * 31) % frame.size] ^= 0x5A
    world.engine.p2p().send(frame, 0, 9, 1.0)
    try:
        _src, payload = m.recv(0, 9, timeout=1)
    except m.FrameError:
        return
    assert flips == 0 and payload["x"].tolist() == [0, 1, 2, 3, 4]


# ---- the transport envelope (pure) ---------------------------------------------------------------

def as_array(env: bytearray) -> np.ndarray:
    return np.frombuffer(env, np.uint8)


def reassemble(env: bytearray, segments: list[np.ndarray], tag: int) -> np.ndarray:
    envelope = parse_envelope(as_array(env))
    assert envelope.tag == tag
    assert envelope.lengths == [s.size for s in segments] and len(envelope.lengths) <= MAX_SEGMENTS
    out = np.concatenate([envelope.inline, *segments]) if segments else envelope.inline.copy()
    assert out.size == envelope.total
    return out


part_sizes = st.lists(st.one_of(st.integers(0, 400), st.sampled_from([30000, 65535, 65536, 70000, 200000])),
                      max_size=40)


@settings(max_examples=150, deadline=None)
@given(part_sizes, st.integers(0, 2**32 - 2))
def test_envelope_plan_round_trips(sizes, tag):
    parts = [np.full(n, i % 251, dtype=np.uint8) for i, n in enumerate(sizes)]
    env, segments = plan_frame(parts, tag)
    assert HEADER_NBYTES <= len(env) <= ENVELOPE_MAX_NBYTES
    assert np.array_equal(reassemble(env, segments, tag), join_frame(parts) if parts else np.empty(0, np.uint8))


def test_a_frame_of_several_parts_that_fits_is_one_inline_envelope():
    parts = [np.arange(40, dtype=np.uint8), np.full(300_000, 7, np.uint8), np.arange(5, dtype=np.uint8)]
    env, segments = plan_frame(parts, 9, inline_nbytes=1 << 19)
    assert segments == []
    parsed = parse_envelope(np.frombuffer(env, np.uint8), inline_nbytes=1 << 19)
    assert parsed.tag == 9 and parsed.lengths == [] and parsed.inline.tobytes() == b"".join(p.tobytes() for p in parts)
    env, segments = plan_frame(parts, 9)  # over the default (MPI) inline limit: the big part is a segment
    assert [s.size for s in segments] == [300_000, 5]  # the leading 40 bytes stay inline


def test_small_frames_travel_inline_and_big_parts_without_copy():
    env, segments = plan_frame([np.ones(INLINE_NBYTES, np.uint8)], 0)
    assert segments == [] and len(env) == HEADER_NBYTES + INLINE_NBYTES <= ENVELOPE_MAX_NBYTES
    header, big = np.ones(40, np.uint8), np.arange(1 << 20, dtype=np.uint8)
    env, segments = plan_frame([header, big], 0)
    assert len(segments) == 1 and np.shares_memory(segments[0], big)
    assert parse_envelope(as_array(env)).inline.size == 40


def test_an_engine_may_inline_more_and_the_receiver_names_its_limit():
    header, body = np.ones(72, np.uint8), np.arange(150_000, dtype=np.int64).astype(np.uint8)
    env, segments = plan_frame([header, body], 9, inline_nbytes=1 << 18)
    assert segments == [] and len(env) > ENVELOPE_MAX_NBYTES
    envelope = parse_envelope(as_array(env), inline_nbytes=1 << 18)
    assert envelope.lengths == [] and np.array_equal(envelope.inline, np.concatenate([header, body]))
    with pytest.raises(MessageError, match="corrupt envelope"):
        parse_envelope(as_array(env))  # more inline bytes than the default limit
    _, split = plan_frame([header, body], 9)
    assert len(split) == 1 and np.shares_memory(split[0], body)


def test_an_envelope_in_a_bigger_receive_buffer_parses_only_when_not_exact():
    env, _ = plan_frame([np.arange(10, dtype=np.uint8)], 7)
    buf = np.zeros(ENVELOPE_MAX_NBYTES, np.uint8)
    buf[:len(env)] = as_array(env)
    envelope = parse_envelope(buf, exact=False)
    assert (envelope.tag, envelope.total, envelope.inline.tolist()) == (7, 10, list(range(10)))
    with pytest.raises(MessageError, match="truncated or padded"):
        parse_envelope(buf)
    with pytest.raises(MessageError, match="truncated or padded"):
        parse_envelope(as_array(env)[:-1])


def test_the_envelope_says_where_the_first_segment_starts_within_a_page():
    backing = np.zeros((1 << 20) + 200, np.uint8)
    for skew in (0, 37, 64):
        segment = backing[skew:skew + (1 << 20)]
        envelope = parse_envelope(as_array(plan_frame([np.ones(72, np.uint8), segment], 3)[0]))
        assert envelope.page_offset == segment.ctypes.data % PAGE_NBYTES
    assert parse_envelope(as_array(plan_frame([np.ones(10, np.uint8)], 3)[0])).page_offset == 0


def test_an_impossible_page_offset_is_a_corrupt_envelope():
    env = bytearray(plan_frame([np.ones(72, np.uint8), np.ones(1 << 17, np.uint8)], 3)[0])
    struct.pack_into("<I", env, HEADER_NBYTES - 4, PAGE_NBYTES)
    with pytest.raises(MessageError, match="page offset"):
        parse_envelope(as_array(env))
    inline_only = bytearray(plan_frame([np.ones(10, np.uint8)], 3)[0])
    struct.pack_into("<I", inline_only, HEADER_NBYTES - 4, 16)
    with pytest.raises(MessageError, match="page offset"):
        parse_envelope(as_array(inline_only))


def test_pooled_receive_buffers_lay_the_payload_where_the_sender_had_it():
    pool = BufferPool()
    first = pool.take(2 << 20, at=72, page_offset=16)
    assert first.size == 2 << 20 and (first.ctypes.data + 72) % PAGE_NBYTES == 16 and first.flags.writeable
    held = pool.take(2 << 20, at=0, page_offset=64)  # ``first`` is still referenced: a new buffer
    assert not np.shares_memory(first, held) and held.ctypes.data % PAGE_NBYTES == 64
    address = first.base.ctypes.data  # holding the base itself would keep it in use
    del first
    again = pool.take(2 << 20, at=72, page_offset=16)
    assert again.base.ctypes.data == address and (again.ctypes.data + 72) % PAGE_NBYTES == 16
    assert pool.take(100, at=5, page_offset=9).size == 100  # small frames: plain buffers


def test_goodbye_envelope_carries_the_goodbye_tag():
    envelope = parse_envelope(as_array(goodbye_envelope()))
    assert envelope.tag == GOODBYE_TAG and envelope.total == 0 and envelope.lengths == []


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=600), st.booleans(), st.booleans())
def test_parse_envelope_raises_only_message_error(raw, keep_magic, exact):
    env = np.frombuffer(raw, np.uint8).copy()
    if keep_magic and env.size >= 6:
        env[:6] = np.frombuffer(b"PMTE\x03\x00", np.uint8)
    try:
        envelope = parse_envelope(env, exact=exact)
    except MessageError:
        return
    assert envelope.inline.size + sum(envelope.lengths) == envelope.total


def test_parse_envelope_rejects_wrong_sizes():
    with pytest.raises(MessageError):
        parse_envelope(np.zeros(10, np.uint8))


def test_frame_parts_accepts_every_buffer_kind():
    parts = frame_parts([b"ab", bytearray(b"c"), memoryview(b"de"), np.arange(2, dtype=np.int16),
                         np.arange(6, dtype=np.uint8).reshape(2, 3)[:, ::2]])
    assert join_frame(parts).tobytes() == b"abcde" + np.arange(2, dtype=np.int16).tobytes() + bytes([0, 2, 3, 5])


def test_loopback_refuses_other_ranks():
    p2p = LoopbackP2P()
    with pytest.raises(ConfigError):
        p2p.send(b"x", 1, 0, 1.0)
    with pytest.raises(ConfigError):
        p2p.recv([], 0, 1.0)


class ScriptedArrivals(P2PBase):
    """A transport whose messages arrive exactly when the script says (no engine, no threads)."""

    def __init__(self, arrivals):
        super().__init__(0, 4)
        self.arrivals = list(arrivals)  # one entry per _fetch call: an (src, data) item or None

    def _fetch(self, sources, tag):
        item = self.arrivals.pop(0) if self.arrivals else None
        assert item is None or sources is None or item[0] in sources, "fetched a message the receive cannot take"
        return item


def test_a_message_arriving_mid_poll_goes_to_the_earliest_receive():
    first_arrives_late = ScriptedArrivals([None, (1, "first"), None, (1, "second")])
    first, second = first_arrives_late.irecv(None, 0), first_arrives_late.irecv(None, 0)
    assert second.wait(1) == (1, "second") and first.done() and first.wait(1) == (1, "first")


def test_a_specific_receive_lets_other_sources_pass():
    transport = ScriptedArrivals([None, (2, "from 2"), (1, "from 1")])
    only_one, anyone = transport.irecv(1, 0), transport.irecv(None, 0)
    assert anyone.wait(1) == (2, "from 2") and only_one.wait(1) == (1, "from 1")


def test_loopback_tables_hold_only_tags_in_use():
    """Per-tag tables are pruned once a tag has nothing posted or queued (p2p memory stays bounded
    by what is in flight, not by every tag ever used)."""
    from popmesh.engines.p2p_base import LoopbackP2P

    p2p = LoopbackP2P()
    for tag in range(200):
        p2p.isend(np.full(4, tag, np.uint8), 0, tag)
    assert p2p.memory() == {"posted_tags": 0, "local_frames": 200}
    handles = [p2p.irecv(0, tag) for tag in range(200, 300)]  # posted, nothing sent yet
    assert p2p.memory()["posted_tags"] == 100
    for tag in range(200):
        assert p2p.recv(0, tag, timeout=5)[1].tolist() == [tag] * 4
    for tag in range(200, 300):
        p2p.isend(b"x", 0, tag)
    assert all(h.wait(5)[1].tobytes() == b"x" for h in handles)
    assert p2p.memory() == {"posted_tags": 0, "local_frames": 0}
    assert p2p._posted == {} and p2p._local == {}


def test_every_service_tag_is_its_own_and_in_its_range():
    """The reserved tags of popmesh's services never meet: each is distinct and inside its service's range."""
    from popmesh.buffers import protocol
    from popmesh.comm.mismatch import MISMATCH_TAG
    from popmesh.engines.p2p_base import HEARTBEAT_TAG
    from popmesh.observe.progress import PROGRESS_TAG
    from popmesh.population.mechanisms.asynchronous.protocol import MAX_INSTANCES, channels

    population = [t for i in range(MAX_INSTANCES) for t in channels(i).__dict__.values()]
    buffers = [protocol.REQUEST_TAG, protocol.SCORE_TAG, protocol.METADATA_TAG, protocol.COORDINATOR_TAG,
               protocol.STATS_TAG]
    tags = [*buffers, *population, MISMATCH_TAG, PROGRESS_TAG, HEARTBEAT_TAG]
    assert len(set(tags)) == len(tags)
    assert all(t in m.BUFFERS_TAGS for t in buffers) and all(t in m.POPULATION_TAGS for t in population)
    assert MISMATCH_TAG in m.GUARD_TAGS and PROGRESS_TAG in m.OBSERVE_TAGS
