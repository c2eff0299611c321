"""Checks of the MPI transport's C path (popmesh.engines.mpi.native) on a real MPI world of 2 ranks:
the bytes it puts on the wire are the Python path's, each path reads what the other sends, and
what it does not decode goes to the Python path, which raises the precise error."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_dtypes

import popmesh
from popmesh import CommTimeout, MessageError
from popmesh.comm import messages as m
from popmesh.engines.envelope import HEADER_NBYTES, INLINE_NBYTES, inline_frame, plan_frame
from popmesh.engines.mpi import p2p as mpi_p2p
from popmesh.engines.p2p_base import frame_parts
from popmesh.wire import decode, encode, encode_message, join_frame
from popmesh.wire.format import NATIVE_DTYPE_CODES, UINT8_CODE
from worldlib import check, skip

# payload bytes around each limit: small frames (4 KiB), one envelope (a 1-d array's frame of at most
# INLINE_NBYTES, its header 40 bytes), a segment below 64 KiB, and the largest frame the C path takes
WHOLE_MAX = INLINE_NBYTES - 40
LIMITS = [0, 1, 4, 4095, 4096, 4097, 20_000, WHOLE_MAX, WHOLE_MAX + 1, 65_536, 336_000, (1 << 20) - 41, 1 << 20]


def _mpi(w) -> bool:
    return w.engine.name == "mpi" and w.size >= 2


def plain_payloads(seed: int) -> list:
    """bytes and numpy arrays of every wire dtype, shape and size limit the C path handles."""
    rng = np.random.default_rng(seed)
    out: list = [rng.integers(0, 256, n, dtype=np.uint8) for n in LIMITS]
    out += [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (0, 3, 4096, 4097, WHOLE_MAX + 1, 336_000)]
    for dtype in NATIVE_DTYPE_CODES:
        a = rng.integers(0, 2, 12).astype(bool) if dtype == np.bool_ else (rng.standard_normal(12) * 50).astype(dtype)
        out += [a.reshape(3, 4), a.reshape(2, 3, 2)[:1]]
    out += [np.array(2.5), np.zeros((0, 7), np.float32), np.ones((4, 0, 2), np.int16),
            (rng.standard_normal(84_000)).astype(np.float32), (rng.standard_normal((200, 210))).astype(np.complex128)]
    return out


def same(want, got) -> bool:
    if type(want) is bytes:
        return type(got) is bytes and got == want
    return (type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
            and got.tobytes() == want.tobytes() and got.flags.writeable and got.flags.c_contiguous)


@check
def the_c_path_is_in_use(w):
    if not _mpi(w):
        skip("MPI worlds only")
    if os.environ.get("POPMESH_MPI_NATIVE") != "1":
        skip("POPMESH_MPI_NATIVE=1 is not set")
    assert w.engine.p2p()._native is not None


@check
def envelopes_are_the_python_paths_bytes(w):
    """What the C path frames equals encode_message + plan_frame, whole or with the payload as segment."""
    native = w.engine.p2p()._native if _mpi(w) else None
    if native is None:
        skip("no C path in this world")
    for i, payload in enumerate(plain_payloads(w.rank)):
        code = UINT8_CODE if type(payload) is bytes else NATIVE_DTYPE_CODES[payload.dtype]
        for checksum in (False, True):
            env, nbytes = native.envelope(payload, code, 9, checksum)
            want, segments = plan_frame(frame_parts(encode_message(payload, checksum=checksum)), 9)
            # the page offset (bytes 24-28) is where the segment lies in memory: the payload itself for
            # the C path, a joined copy for the Python path below 64 KiB
            assert env[:24] + env[28:] == bytes(want[:24]) + bytes(want[28:]), (i, checksum)
            assert nbytes == len(env) - HEADER_NBYTES - 8 * len(segments) + sum(s.size for s in segments), i
            if segments:
                data = np.frombuffer(payload, np.uint8) if type(payload) is bytes else payload.view(np.uint8).ravel()
                assert len(segments) == 1 and segments[0].tobytes() == data.tobytes()
                assert int.from_bytes(env[24:28], "little") == data.ctypes.data % 4096, i
            else:
                assert env[24:28] == bytes(4)
    assert native.envelope(np.ones((4, 4))[:, ::2], NATIVE_DTYPE_CODES[np.dtype(np.float64)], 9, False) is None


def _exchange(w, tag: int) -> None:
    """Rank 0 sends every plain payload to rank 1 with blocking sends, rank 1 sends each back (send or
    isend); both check."""
    for i, payload in enumerate(plain_payloads(7)):
        checksum = True if i % 3 == 0 else None
        if w.rank == 0:
            m.send(payload, 1, tag, checksum=checksum, timeout=30)
            src, back = m.recv(1, tag, timeout=30)
            assert src == 1 and same(payload, back), (tag, i)
        elif w.rank == 1:  # replies alternate between send and isend
            src, got = m.recv(0, tag, timeout=30)
            assert src == 0 and same(payload, got), (tag, i)
            if i % 2:
                m.isend(got, 0, tag, checksum=checksum).wait(30)
            else:
                m.send(got, 0, tag, checksum=checksum, timeout=30)


@check
def c_and_python_paths_read_each_other(w):
    """Every pairing of the two paths (C to C, C to Python, Python to C, Python to Python), each way."""
    if not _mpi(w):
        skip("MPI worlds only")
    p2p = w.engine.p2p()
    native = p2p._native
    try:
        for phase, python_ranks in enumerate([(), (1,), (0,), (0, 1)]):
            p2p._native = None if w.rank in python_ranks else native
            _exchange(w, 40 + phase)
    finally:
        p2p._native = native
    popmesh.barrier(timeout=30)


@check
def frames_the_c_path_does_not_decode_go_to_the_python_decoder(w):
    """Valid frames it leaves to Python (JSON, bfloat16, a frame sent whole in one segment) arrive as
    values; damaged ones (payload, header, small or segmented) raise FrameError; the receiver goes on."""
    if not _mpi(w):
        skip("MPI worlds only")
    small = join_frame(encode(np.arange(100, dtype=np.int64)))
    bad_payload, bad_header = small.copy(), small.copy()
    bad_payload[-3] ^= 0xFF
    bad_header[21] ^= 0x01  # the payload length
    big = join_frame(encode(np.arange(90_000, dtype=np.float32), checksum=True))  # one segment, nothing inline
    bad_big = big.copy()
    bad_big[-5] ^= 0xFF
    good = [join_frame(encode({"json": [1, 2]})), join_frame(encode(np.ones(3, ml_dtypes.bfloat16))), big]
    frames = [bad_payload, good[0], bad_header, good[1], bad_big, good[2]]
    if w.rank == 0:
        for frame in frames:
            w.engine.p2p().send(frame, 1, 44, 30)
    elif w.rank == 1:
        got = []
        for _ in frames:
            try:
                got.append(m.recv(0, 44, timeout=30)[1])
            except m.FrameError as e:
                assert e.src == 0 and e.tag == 44
                got.append("FrameError")
        assert got[0] == got[2] == got[4] == "FrameError", got
        assert got[1] == {"json": [1, 2]} and got[3].dtype == ml_dtypes.bfloat16, got
        assert np.array_equal(got[5], np.arange(90_000, dtype=np.float32))
    popmesh.barrier(timeout=30)


@check
def a_segment_still_arriving_is_finished_by_the_python_path(w):
    """An envelope whose segment comes 0.3 s later: the C path's brief spin gives the receive to the
    Python path, which completes it whole."""
    if not _mpi(w):
        skip("MPI worlds only")
    payload = np.arange(84_000, dtype=np.float32)
    p2p = w.engine.p2p()
    if w.rank == 0:
        env, segments = plan_frame(frame_parts(encode_message(payload, checksum=False)), 45)
        assert len(segments) == 1
        p2p._comm.Send(bytes(env), 1, 2 * 45)
        time.sleep(0.3)
        p2p._comm.Send(segments[0], 1, 2 * 45 + 1)
    elif w.rank == 1:
        handed: list = []
        finish = p2p._recv_rest
        p2p._recv_rest = lambda got, *args: handed.append(len(got.reqs)) or finish(got, *args)  # a spy on the hand-over
        try:
            src, got = m.recv(0, 45, timeout=30)
        finally:
            del p2p._recv_rest
        assert src == 0 and np.array_equal(got, payload)
        assert handed == [1], handed  # the C path's one segment receive, still arriving when handed over
    popmesh.barrier(timeout=30)


@check
def a_send_its_receiver_has_not_received_times_out_and_stays_in_flight(w):
    """A 336 KB blocking send to a rank that receives 1 s later: CommTimeout naming it after 0.3 s, then
    the message arrives intact, and the transport lets go of the finished send."""
    if not _mpi(w):
        skip("MPI worlds only")
    payload = np.arange(84_000, dtype=np.float32)
    if w.rank == 0:
        start = time.monotonic()
        try:
            m.send(payload, 1, 46, timeout=0.3)
        except CommTimeout as e:
            assert e.missing == (1,) and time.monotonic() - start < 0.9, (e, time.monotonic() - start)
        else:
            raise AssertionError("the send completed before its receiver received")
    elif w.rank == 1:
        time.sleep(1.0)
        assert np.array_equal(m.recv(0, 46, timeout=30)[1], payload)
    popmesh.barrier(timeout=30)
    if w.rank == 0:
        p2p = w.engine.p2p()
        assert all(op.done() for op in p2p._in_flight), "a completed send is still pending"


@check
def every_spin_gives_way_when_nothing_comes(w):
    """A receive that times out takes nothing (the C path's spin returned empty), and the message sent
    afterwards goes to the next receive."""
    if not _mpi(w):
        skip("MPI worlds only")
    if w.rank == 1:
        start = time.monotonic()
        try:
            m.recv(0, 47, timeout=0.2)
        except CommTimeout:
            assert 0.15 < time.monotonic() - start < 2.0
        else:
            raise AssertionError("received a message nobody sent")
    popmesh.barrier(timeout=30)
    if w.rank == 0:
        m.send(np.float32([1.0]), 1, 47)
    elif w.rank == 1:
        assert m.recv(0, 47, timeout=30)[1].tolist() == [1.0]
    popmesh.barrier(timeout=30)
    assert mpi_p2p._SEGMENT_MAX == 1 << 20


def _python_reading(env: bytes, tag: int):
    """What the Python path makes of a received envelope: the decoded value, None (not a frame carried
    whole: parse_envelope decides) or the MessageError it raises."""
    frame = inline_frame(np.frombuffer(env, np.uint8).copy(), tag)
    if frame is None:
        return None
    try:
        return decode(frame)
    except MessageError as e:
        return e


@check
def damaged_envelopes_decode_to_the_python_paths_value_or_go_to_it(w):
    """Seeded random damage to envelopes (bytes flipped, cut short, lengthened), each sent by a rank to
    itself: whatever the C path decodes, the Python decoder decodes to the same value; everything
    else comes back as the envelope received, byte for byte. Undamaged ones are decoded in C."""
    native = w.engine.p2p()._native if _mpi(w) else None
    if native is None:
        skip("no C path in this world")
    p2p, tag, me = w.engine.p2p(), 48, w.rank
    codes = {np.dtype(np.float32): NATIVE_DTYPE_CODES[np.dtype(np.float32)]}
    payloads = [b"", b"popmesh", np.arange(6, dtype=np.float32).reshape(2, 3), np.array(1.5, dtype=np.float32),
                np.arange(1000, dtype=np.float32)]
    bases = [native.envelope(p, UINT8_CODE if type(p) is bytes else codes[p.dtype], tag, False)[0] for p in payloads]
    rng = np.random.default_rng(20261127 + me)
    decoded = damaged = 0
    for trial in range(2500):
        env = bytearray(bases[trial % len(bases)])
        damage = trial % 4
        if damage == 1:
            for at in rng.integers(0, len(env), rng.integers(1, 4)):
                env[at] ^= int(rng.integers(1, 256))
        elif damage == 2:
            del env[int(rng.integers(0, len(env))):]
        elif damage == 3:
            env += bytes(rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8))
        sent = p2p._comm.Isend(bytes(env), me, 2 * tag)
        state, value, _, request, _ = native.probe(p2p._handle, me, 2 * tag, 1.0, 0.0, 1 << 20)
        sent.Wait()
        if state == 2:  # the damage announced a segment that will never come: withdraw its receive
            pending = p2p.mpi.Request.f2py(request)
            pending.Cancel()
            pending.Wait()
        python = _python_reading(bytes(env), tag)
        if state == 1:
            assert not isinstance(python, Exception) and python is not None and same(python, value), (trial, env)
            decoded += 1
        else:
            assert state in (0, 2, 3, 4) and (state != 0 or bytes(value) == bytes(env)), (trial, state)
            assert damage != 0, (trial, "an undamaged envelope was not decoded in C")
            damaged += 1
    assert decoded == 625 and damaged == 1875, (decoded, damaged)  # every byte of a small frame is checked


@check
def threads_on_their_own_tags_keep_order_and_lose_nothing(w):
    """Three threads per rank, each its own tag, sending (rank 0) and receiving (rank 1) through the C
    path at once (its receive spins run with the GIL released, side by side): every message arrives,
    in order, on its tag, and the credits the receiver keeps for the window add up."""
    if not _mpi(w):
        skip("MPI worlds only")
    import threading

    count, tags, errors = 300, (50, 51, 52), []

    def sender(tag: int) -> None:
        try:
            for i in range(count):
                m.send(np.array([tag, i], np.int64) if i % 2 else bytes([tag % 256, i % 256]), 1, tag, timeout=30)
        except Exception as e:  # reported below: a thread's exception would be lost
            errors.append(e)

    def receiver(tag: int) -> None:
        try:
            for i in range(count):
                src, got = m.recv(0, tag, timeout=30)
                want = [tag, i] if i % 2 else bytes([tag % 256, i % 256])
                assert src == 0 and (got.tolist() if i % 2 else got) == want, (tag, i, got)
        except Exception as e:
            errors.append(e)

    if w.rank in (0, 1):
        threads = [threading.Thread(target=sender if w.rank == 0 else receiver, args=(tag,)) for tag in tags]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors
    popmesh.barrier(timeout=30)
    if w.rank == 1:
        taken = w.engine.p2p()._counters[0].taken
        assert taken >= len(tags) * count, taken  # every frame taken was counted for the sender's window


@check
def a_segment_shorter_than_announced_raises_on_both_paths(w):
    """An envelope announcing 100,000 bytes whose segment brings 8: MessageError on the C path and on the
    Python path (never the buffer's unwritten rest as data), and the next message arrives intact."""
    if not _mpi(w):
        skip("MPI worlds only")
    p2p = w.engine.p2p()
    native = p2p._native
    assert p2p._post_value(bytes(1 << 20), 1 - w.rank, 53, None) is False  # bytes of 1 MiB: the Python path
    for python in (False, True):
        if w.rank == 0:
            env, _ = plan_frame(frame_parts(encode_message(np.zeros(25_000, np.float32), checksum=False)), 53)
            p2p._comm.Send(bytes(env), 1, 2 * 53)
            p2p._comm.Send(np.ones(8, np.uint8), 1, 2 * 53 + 1)
            m.send(np.float32([7.0]), 1, 53)
        elif w.rank == 1:
            p2p._native = None if python else native
            try:
                try:
                    got = m.recv(0, 53, timeout=30)
                except MessageError as e:
                    assert "arrived where its envelope announced" in str(e), e
                else:
                    raise AssertionError(f"a short segment was decoded: {got}")
                assert m.recv(0, 53, timeout=30)[1].tolist() == [7.0]
            finally:
                p2p._native = native
        popmesh.barrier(timeout=30)


@check
def two_threads_receiving_on_one_channel_never_cross_frames(w):
    """Two threads of rank 1 receive from rank 0 on the same tag at once (one on the C path, the other
    held off it meanwhile): every frame arrives whole, its length and its contents its own, none twice."""
    if not _mpi(w):
        skip("MPI worlds only")
    import threading

    count, got, errors = 120, [], []

    def receive() -> None:
        try:
            for _ in range(count // 2):
                got.append(m.recv(0, 54, timeout=60)[1])
        except Exception as e:
            errors.append(e)

    if w.rank == 0:  # all posted at once, each frame its own length: crossed segments could not go unnoticed
        sends = [m.isend(np.full(20_000 + i, i, np.int32), 1, 54) for i in range(count)]
        for h in sends:
            h.wait(60)
    elif w.rank == 1:
        threads = [threading.Thread(target=receive) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert all(a.size == 20_000 + int(a[0]) and (a == a[0]).all() for a in got)
        assert sorted(int(a[0]) for a in got) == list(range(count))
    popmesh.barrier(timeout=60)


@check
def two_threads_sending_on_one_channel_never_cross_frames(w):
    """Two threads of rank 0 send to rank 1 on the same tag at once, one through the C path, the other
    through the Python path (non-contiguous arrays): every frame arrives whole, its length its own."""
    if not _mpi(w):
        skip("MPI worlds only")
    import threading

    count, errors = 60, []

    def send(python: int) -> None:
        try:
            handles = []
            for i in range(count):
                n = 20_000 + 2 * i + python  # each frame its own length, its values (thread, index)
                values = np.full(2 * n if python else n, 1000 * python + i, np.int32)
                handles.append(m.isend(values[::2] if python else values, 1, 55))
            for h in handles:
                h.wait(60)
        except Exception as e:
            errors.append(e)

    if w.rank == 0:
        threads = [threading.Thread(target=send, args=(python,)) for python in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors and not any(t.is_alive() for t in threads), errors
    elif w.rank == 1:
        seen = []
        for _ in range(2 * count):
            a = m.recv(0, 55, timeout=60)[1]
            python, i = divmod(int(a[0]), 1000)
            assert (a == a[0]).all() and a.size == 20_000 + 2 * i + python, (a.size, python, i)
            seen.append((python, i))
        assert sorted(seen) == sorted((p, i) for p in (0, 1) for i in range(count))
        assert [i for p, i in seen if p == 0] == list(range(count)) == [i for p, i in seen if p == 1]  # each in order
    popmesh.barrier(timeout=60)
