"""Checks of point-to-point messages on a real world; a sender's rank r shows up as r + 1 in its data.

Ring checks send to ``(r + 1) % n`` and receive from ``(r - 1) % n`` (in a world of one: itself).
Sends are started with isend before receiving, so large (rendezvous) messages cannot deadlock.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_dtypes
import torch

import popmesh
from popmesh import CommTimeout, ConfigError, MessageError, NotInGroup
from popmesh.comm import messages as m
from popmesh.wire import encode, join_frame
from worldlib import check, main

NP_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
                torch.int64, torch.uint8, torch.bool, torch.complex64]
SIZES = [0, 1, 7, 300, 359, 360, 361, 511, 512, 4096, 65535, 65536, 65537, 200_000, 261_949,
         524_092, 524_093,  # the largest frame gloo sends inline (a 40-byte header), and one more byte
         (1 << 20) + 3, 8 << 20]


def ring(w):
    return (w.rank + 1) % w.size, (w.rank - 1) % w.size


def payloads(r):
    """Every payload kind, encoding the sender's rank ``r``; returns (payload, expected) pairs."""
    v = r + 1
    out = [b"", bytes([v]) * 5, bytearray(b"abc") + bytes([v])]
    for name in NP_DTYPES:
        a = (np.arange(6) % 2 == v % 2) if name == "bool" else (np.arange(6) + v).astype(name)
        out.append(a.reshape(2, 3))
    out.append((np.arange(12.0) * v).reshape(3, 4)[:, ::2])  # non-contiguous
    out.append(np.array(float(v)))  # 0-d
    out.append((np.arange(4) + v).astype(ml_dtypes.bfloat16))
    for dt in TORCH_DTYPES:
        t = torch.arange(6) % 2 == v % 2 if dt == torch.bool else (torch.arange(6) + v).to(dt)
        out.append(t.reshape(3, 2))
    out.append(torch.zeros(2, 0, 3))
    out.append({"rank": r, "text": "héllo", "nested": [1, 2.5, None, True, {"x": []}], "inf": float("inf")})
    out.append(v)
    out.append("just a string")
    out.append({"obs": np.ones((3, 2), np.float32) * v, "actions": torch.arange(3) + v,
                "log_rewards": np.array([-1.0, -np.inf, float(v)])})
    return out


def same(a, b):
    if isinstance(a, (bytes, bytearray)):
        return type(b) is bytes and bytes(a) == b
    if isinstance(a, np.ndarray):
        want = a.copy(order="C")  # ascontiguousarray would turn 0-d into 1-d
        return isinstance(b, np.ndarray) and b.dtype == want.dtype and b.shape == want.shape and \
            want.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and a and all(not isinstance(x, (int, str, list, dict, float)) for x in a.values()):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@check
def payload_kinds(w):
    nxt, prv = ring(w)
    handles = [m.isend(p, nxt, tag=1) for p in payloads(w.rank)]
    for i, want in enumerate(payloads(prv)):
        src, got = m.recv(prv, tag=1, timeout=30)
        assert src == prv and same(want, got), (i, type(want), want, got)
    for h in handles:
        h.wait()
        assert h.done()


@check
def tensors_on_device(w):
    nxt, prv = ring(w)
    h = m.isend(torch.full((3,), w.rank + 1.0, dtype=torch.bfloat16), nxt, tag=2)
    _, t = m.recv(prv, 2, device="cpu")
    assert t.device.type == "cpu" and t.dtype == torch.bfloat16 and torch.all(t == prv + 1)
    h.wait()
    h = m.isend(torch.ones(2), nxt, tag=2)
    _, t = m.recv(prv, 2, device="same")
    assert t.device.type == "cpu"
    h.wait()


@check
def pickle_only_when_both_allow(w):
    nxt, prv = ring(w)
    try:
        m.send({1, 2}, nxt, tag=3)
    except MessageError:
        pass
    else:
        raise AssertionError("a set needs pickle")
    h = m.isend({w.rank, "x"}, nxt, tag=3, allow_pickle=True)
    h2 = m.isend((w.rank, 1), nxt, tag=3, allow_pickle=True)
    try:
        m.recv(prv, 3)
    except m.FrameError as e:
        assert e.src == prv and e.tag == 3 and "allow_pickle" in str(e)
    else:
        raise AssertionError("the receiver did not allow pickle")
    assert m.recv(prv, 3, allow_pickle=True) == (prv, (prv, 1))
    h.wait()
    h2.wait()


@check
def sizes_zero_to_8mb(w):
    nxt, prv = ring(w)
    handles = [m.isend(np.full(n, (w.rank + 1 + n) % 251, dtype=np.uint8), nxt, tag=4) for n in SIZES]
    for n in SIZES:
        _, got = m.recv(prv, 4, timeout=60)
        assert got.shape == (n,) and np.all(got == (prv + 1 + n) % 251), n
    for h in handles:
        h.wait(60)


@check
def received_payloads_stay_intact_while_held(w):
    """Large inline payloads arrive in the transport's own receive buffers (gloo hands them over): keeping
    many alive while more arrive must not let a buffer be reused under them, and dropping them must not
    break later receives."""
    nxt, prv = ring(w)
    for round_ in range(2):
        handles = [m.isend(np.full(300_000, (w.rank + 7 * i + round_) % 251, dtype=np.uint8), nxt, tag=6)
                   for i in range(20)]
        held = [m.recv(prv, 6, timeout=60)[1] for _ in range(20)]
        for i, got in enumerate(held):
            assert got.shape == (300_000,) and np.all(got == (prv + 7 * i + round_) % 251), (round_, i)
        for h in handles:
            h.wait(60)
        del held


@check
def raw_bytes_sizes(w):
    """Bytes payloads (read-only buffers) across the inline/segment boundaries."""
    nxt, prv = ring(w)
    sizes = [0, 300, 400, 70000]
    handles = [m.isend(bytes([w.rank + 1]) * n, nxt, tag=5) for n in sizes]
    for n in sizes:
        assert m.recv(prv, 5)[1] == bytes([prv + 1]) * n
    for h in handles:
        h.wait()


@check
def big_64mb(w):
    src, dst = 0, 1 % w.size
    numel = 16 << 20  # 64 MiB of float32
    h = None
    if w.rank == src:
        h = m.isend(np.arange(numel, dtype=np.float32), dst, tag=6)
    if w.rank == dst:
        got_src, got = m.recv(src, 6, timeout=120)
        assert got_src == src and got.dtype == np.float32 and got.shape == (numel,)
        assert got[0] == 0 and got[-1] == numel - 1 and got[12345678] == 12345678
    if h is not None:
        h.wait(120)


@check
def any_source_names_sender(w):
    h = m.isend(np.array([w.rank + 1]), 0, tag=7)
    if w.rank == 0:
        seen = {}
        for _ in range(w.size):
            src, payload = m.recv(None, 7)
            seen[src] = int(payload[0])
        assert seen == {r: r + 1 for r in range(w.size)}, seen
    h.wait()


@check
def tags_are_independent_channels(w):
    """Two channels in flight between one pair (one message of 1 MB among them); order per channel kept."""
    src, dst = 0, 1 % w.size
    handles = []
    if w.rank == src:
        for i in range(10):
            handles.append(m.isend(np.full(1 << 18 if i == 4 else 3, i), dst, tag=10))
            handles.append(m.isend(f"B{i}", dst, tag=11))
    if w.rank == dst:
        assert [m.recv(src, 11)[1] for _ in range(10)] == [f"B{i}" for i in range(10)]
        got = [m.recv(src, 10)[1] for _ in range(10)]
        assert [int(a[0]) for a in got] == list(range(10)) and got[4].size == 1 << 18
    for h in handles:
        h.wait()


@check
def irecv_handles_match_in_posting_order(w):
    src, dst = 0, 1 % w.size
    first = second = None
    if w.rank == dst:
        first, second = m.irecv(src, tag=12), m.irecv(src, tag=12)
        assert not first.done()
    popmesh.barrier()
    handles = [m.isend("first", dst, 12), m.isend("second", dst, 12)] if w.rank == src else []
    if w.rank == dst:
        got = second.wait(30)
        assert got == (src, "second"), got
        assert first.done() and first.wait() == (src, "first")
    for h in handles:
        h.wait()
        assert h.done()


@check
def timeout_then_late_message_arrives(w):
    src, dst = 0, 1 % w.size
    if w.rank == dst:
        start = time.monotonic()
        try:
            m.recv(src, tag=13, timeout=0.5)
        except CommTimeout as e:
            assert time.monotonic() - start < 5, time.monotonic() - start
            assert e.missing == (src,), e.missing
        else:
            raise AssertionError("nothing was sent yet: the receive must time out")
        late = m.irecv(src, tag=14)
        try:
            late.wait(0.3)
        except CommTimeout:
            pass
        else:
            raise AssertionError("the irecv must time out too")
        if w.size > 1:
            m.send("gave up", src, tag=12)  # both receives above have given up: now the late messages
    if w.rank == src:
        if w.size > 1:
            assert m.recv(dst, tag=12, timeout=30) == (dst, "gave up")
        m.send("late", dst, tag=13)
        m.send("late handle", dst, tag=14)
    if w.rank == dst:
        assert m.recv(src, 13, timeout=30) == (src, "late")
        assert late.wait(30) == (src, "late handle")


@check
def bad_frames_raise_and_receiver_keeps_working(w):
    src, dst = 0, 1 % w.size
    good = join_frame(encode(np.arange(100, dtype=np.int64)))
    corrupt = good.copy()
    corrupt[-3] ^= 0xFF
    foreign = good.copy()
    foreign[:4] = np.frombuffer(b"XXXX", np.uint8)
    bad = [b"", b"garbage that is no frame at all, but long enough to parse" * 3, good[: good.size // 2],
           corrupt, foreign, np.concatenate([good, np.zeros(5, np.uint8)])]
    if w.rank == src:
        raw = w.engine.p2p()
        for frame in bad:
            raw.send(frame, dst, 15, 30)
        m.send("still fine", dst, tag=15)
    if w.rank == dst:
        for i in range(len(bad)):
            try:
                m.recv(src, 15)
            except MessageError as e:
                assert isinstance(e, m.FrameError) and e.src == src
            else:
                raise AssertionError(f"bad frame {i} decoded")
        assert m.recv(src, 15) == (src, "still fine")


@check
def group_restricts_any_source(w):
    g = w.new_group(sorted({0, w.size - 1}))
    if w.size < 3:
        return
    if w.rank == 1:
        m.send("from 1", 0, tag=16)
    popmesh.barrier()
    if w.rank == w.size - 1:
        m.send("from last", 0, tag=16, group=g)
    if w.rank == 0:
        assert m.recv(None, 16, group=g) == (w.size - 1, "from last")
        assert m.recv(None, 16) == (1, "from 1")


@check
def bad_arguments_are_config_errors(w):
    for tag in (m.INTERNAL_TAG_BASE, m.TAG_LIMIT - 1, -1, m.TAG_LIMIT, 1.5, True):
        for call in (lambda tag=tag: m.send(1, 0, tag), lambda tag=tag: m.recv(0, tag, timeout=0.1)):
            try:
                call()
            except ConfigError:
                pass
            else:
                raise AssertionError(f"tag {tag!r} accepted")
    for dst in (w.size, -1, "0"):
        try:
            m.send(1, dst)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"dst {dst!r} accepted")
    p2p = getattr(w.engine, "p2p", None)  # the transport's own checks, behind its small-frame fast paths
    if p2p is not None:
        small = b"frame"
        for dst, tag in ((w.size, 0), (-1, 0), (True, 0), (1.0, 0), (0, -1), (0, m.TAG_LIMIT), (0, True)):
            try:
                p2p().send(small, dst, tag, 1.0)
            except ConfigError:
                pass
            else:
                raise AssertionError(f"p2p send to {dst!r} on tag {tag!r} accepted")
        for src, tag in ((w.size, 0), (-1, 0), (True, 0), (0, -1), (0, m.TAG_LIMIT)):
            try:
                p2p().recv(src, tag, 0.1)
            except ConfigError:
                pass
            else:
                raise AssertionError(f"p2p recv from {src!r} on tag {tag!r} accepted")
    only0 = w.new_group([0])
    if w.rank == 0 and w.size > 1:
        try:
            m.send(1, 1, group=only0)
        except ConfigError:
            pass
        else:
            raise AssertionError("dst outside the group accepted")
    if w.rank != 0:
        try:
            m.recv(0, group=only0, timeout=0.1)
        except NotInGroup:
            pass
        else:
            raise AssertionError("a non-member received on a group")


@check
def on_arrival_signals_deliveries(w):
    """gloo and the local engine call back on arrival (any tag); MPI says None: poll there."""
    import threading

    event = threading.Event()
    stop = m.on_arrival(event.set)
    if w.engine_name == "mpi":
        assert stop is None
        return
    assert stop is not None
    src, dst = (w.rank - 1) % w.size, (w.rank + 1) % w.size
    handle = m.irecv(src, tag=16)
    handle.done()  # gloo starts listening to src on the first poll
    popmesh.barrier()
    m.send(f"ping {w.rank}", dst, tag=16)
    assert event.wait(30), "no arrival signalled"
    assert handle.wait() == (src, f"ping {src}")
    stop()
    event.clear()
    popmesh.barrier()
    m.send("after stop", dst, tag=17)
    assert m.recv(src, 17) == (src, "after stop")
    assert not event.is_set(), "signalled after stop()"


# One size inline everywhere, the largest gloo inline frame, the first with a gloo segment, and
# sizes above MPI's inline limit and its eager/rendezvous switch.
PROGRESS_SIZES = [1024, 524_092, 524_093, 1 << 20, 8 << 20]


def _filled(nbytes, value):
    return np.full(max(1, nbytes // 8), value, dtype=np.int64)


def _expect(got, nbytes, value, what):
    assert isinstance(got, np.ndarray) and got.size == max(1, nbytes // 8), (what, getattr(got, "size", got))
    assert int(got[0]) == value and int(got[-1]) == value, (what, int(got[0]), value)


@check
def ring_exchange_progresses_whatever_is_waited_first(w):
    """``hs = isend(x, right); hr = irecv(left); hs.wait(); hr.wait()``: correct under MPI's progress
    rule (a posted receive progresses whatever the caller waits on), at every size."""
    nxt, prv = ring(w)
    for nbytes in PROGRESS_SIZES:
        for send_first in (True, False):
            hs = m.isend(_filled(nbytes, w.rank + 1), nxt, tag=18)
            hr = m.irecv(prv, tag=18)
            if send_first:
                hs.wait(20)
                src, got = hr.wait(20)
            else:
                src, got = hr.wait(20)
                hs.wait(20)
            assert src == prv
            _expect(got, nbytes, prv + 1, (nbytes, send_first))


@check
def halo_exchange_in_every_wait_order(w):
    """Send to both neighbours, receive from both, and wait on the four handles in each of the 24 orders."""
    import itertools

    nxt, prv = ring(w)
    for nbytes in (1024, 524_093, 1 << 20):
        for order in itertools.permutations(range(4)):
            handles = [m.isend(_filled(nbytes, 100 + w.rank), nxt, tag=19),
                       m.isend(_filled(nbytes, 200 + w.rank), prv, tag=20),
                       m.irecv(prv, tag=19), m.irecv(nxt, tag=20)]
            got = {}
            for i in order:
                got[i] = handles[i].wait(20)
            assert got[2][0] == prv and got[3][0] == nxt
            _expect(got[2][1], nbytes, 100 + prv, (nbytes, order, "from the left"))
            _expect(got[3][1], nbytes, 200 + nxt, (nbytes, order, "from the right"))
    big = 8 << 20  # the largest size once, sends waited first
    hs = [m.isend(_filled(big, 100 + w.rank), nxt, tag=19), m.isend(_filled(big, 200 + w.rank), prv, tag=20)]
    hr = [m.irecv(prv, tag=19), m.irecv(nxt, tag=20)]
    for h in hs:
        h.wait(30)
    _expect(hr[0].wait(30)[1], big, 100 + prv, "8 MB from the left")
    _expect(hr[1].wait(30)[1], big, 200 + nxt, "8 MB from the right")


@check
def posted_receive_progresses_while_another_tag_is_waited_on(w):
    """The receiver waits on tag 22 first while the sender's blocking send on tag 21 comes first."""
    src, dst = 0, 1 % w.size
    if w.rank == dst:
        first, second = m.irecv(src, tag=21), m.irecv(src, tag=22)
    popmesh.barrier()
    if w.rank == src:
        handles = []
        for nbytes in (1 << 20, 8 << 20):
            if src == dst:
                handles += [m.isend(_filled(nbytes, 21), dst, 21), m.isend(_filled(nbytes, 22), dst, 22)]
            else:
                m.send(_filled(nbytes, 21), dst, 21, timeout=20)
                m.send(_filled(nbytes, 22), dst, 22, timeout=20)
    if w.rank == dst:
        for nbytes in (1 << 20, 8 << 20):
            _expect(second.wait(20)[1], nbytes, 22, ("tag 22", nbytes))
            _expect(first.wait(20)[1], nbytes, 21, ("tag 21", nbytes))
            first, second = m.irecv(src, tag=21), m.irecv(src, tag=22)
    if w.rank == src and src == dst:
        for h in handles:
            h.wait(20)


@check
def zz_all_done(w):
    popmesh.barrier(timeout=60)


if __name__ == "__main__":
    main()
