"""The gloo send queue lets callers of eager sends go on only while it holds few, small frames.

The works here stand in for gloo's send works only to hold the queue still; what crosses processes
is tested in tests/world (test_messages.py).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")

from popmesh.engines.torch.send import Outbox, TorchSend


class HeldWork:
    """A send that completes when the test says so."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self, timeout) -> None:
        self.release.wait(10)


def test_eager_sends_stop_returning_at_once_beyond_16_mib_queued():
    box, held = Outbox(dst=1, tag=5), HeldWork()
    ops = [TorchSend([held], [np.zeros(1 << 20, np.uint8)], True, box) for _ in range(17)]
    for op in ops[:16]:
        box.push(op)
    assert box.bounded() and ops[0].done()  # 16 MiB held for gloo: callers go on
    box.push(ops[16])
    assert not box.bounded() and not ops[16].done()  # 17 MiB: callers wait for completions
    held.release.set()
    ops[16].wait(10)
    assert all(op.done() for op in ops) and box.bounded()


def test_a_send_with_segments_is_never_eager():
    box, held = Outbox(dst=1, tag=6), HeldWork()
    op = TorchSend([held], [bytearray(40), np.zeros(1 << 17, np.uint8)], False, box)
    box.push(op)
    assert op.nbytes == 40 + (1 << 17) and not op.done()
    held.release.set()
    op.wait(10)
    assert op.done()


def test_eager_sends_wait_once_every_channel_together_holds_64_mib():
    """The per-channel bound alone let a rank hold 16 MiB per (destination, tag): unbounded in peers
    and tags. All channels of a rank share one budget."""
    from popmesh.engines.torch.send import EAGER_TOTAL_NBYTES, SendWorkers

    workers, held = SendWorkers(), HeldWork()
    boxes = [Outbox(dst=1, tag=tag, workers=workers) for tag in range(5)]
    ops = []
    for box in boxes:
        for _ in range(13):  # 13 MiB per channel: each channel alone stays under its 16 MiB
            op = TorchSend([held], [np.zeros(1 << 20, np.uint8)], True, box)
            box.push(op)
            ops.append(op)
    assert workers.eager_nbytes() == 65 << 20 > EAGER_TOTAL_NBYTES
    assert all(box._queued_nbytes <= 16 << 20 for box in boxes)
    assert not boxes[0].bounded() and not ops[-1].done()  # 65 MiB in all: callers wait
    held.release.set()
    ops[-1].wait(10)
    assert all(op.done() for op in ops)
    deadline = time.monotonic() + 10
    while workers.eager_nbytes() and time.monotonic() < deadline:  # the workers reap every REAP_S
        time.sleep(0.01)
    assert workers.eager_nbytes() == 0
    workers.close(5)


def test_eager_envelope_buffers_are_recycled_once_their_send_completed():
    from popmesh.engines.torch.send import RECYCLE_MIN, SendBuffers

    pool = SendBuffers(cap=3 * RECYCLE_MIN)
    small = pool.take(100)
    assert small.size == 100 and pool.base(small) is None  # small ones are plain new arrays
    first = pool.take(RECYCLE_MIN + 5)
    base = pool.base(first)
    assert first.size == RECYCLE_MIN + 5 and base is not None and base.size == 2 * RECYCLE_MIN
    assert pool.base(pool.take(RECYCLE_MIN + 5)) is not base  # still in flight: not handed out twice
    pool.give_back(base)
    assert pool.idle_nbytes() == 2 * RECYCLE_MIN
    assert pool.base(pool.take(2 * RECYCLE_MIN - 1)) is base and pool.idle_nbytes() == 0  # same size class
    pool.give_back(base)
    pool.give_back(np.empty(2 * RECYCLE_MIN, np.uint8))  # past the cap: dropped
    assert pool.idle_nbytes() == 2 * RECYCLE_MIN


def test_a_failed_send_never_recycles_its_buffer():
    from popmesh.engines.torch.send import RECYCLE_MIN, SendBuffers

    class FailedWork:
        def wait(self, timeout) -> None:
            raise RuntimeError("Connection closed by peer")

    pool = SendBuffers()
    env = pool.take(RECYCLE_MIN)
    op = TorchSend([FailedWork()], [env], True, Outbox(1, 0), (pool, pool.base(env)))
    op.complete()
    assert op.error is not None and pool.idle_nbytes() == 0


def test_a_send_gloo_never_ends_is_abandoned_once_its_receiver_failed():
    """gloo may never end a send whose receiver died (a send it queued to retry when the connection
    broke is not signalled when it then sees the connection closed). Once the receiver is known
    failed, every send of its channels fails at once, the worker gloo holds is let go (close does not
    wait for it, and another worker serves the other channels: here the only one), and new sends to it
    fail too."""
    from popmesh.core.errors import CommTimeout, PeerFailure
    from popmesh.engines.torch.send import SendWorkers

    workers, stuck, fine = SendWorkers(threads=1), HeldWork(), HeldWork()
    dead, alive = Outbox(dst=1, tag=5, workers=workers), Outbox(dst=2, tag=5, workers=workers)
    try:
        first, behind = (TorchSend([stuck], [np.zeros(64, np.uint8)], False, dead) for _ in range(2))
        dead.push(first)
        dead.push(behind)
        deadline = time.monotonic() + 5
        while not dead._serving and time.monotonic() < deadline:
            time.sleep(0.005)
        assert dead._serving, "a worker should be completing the first send"
        other = TorchSend([fine], [np.zeros(64, np.uint8)], False, alive)
        fine.release.set()
        alive.push(other)
        with pytest.raises(CommTimeout):
            other.wait(0.2)  # the only worker is held by gloo
        workers.abandon([dead], PeerFailure("rank 1 failed", (1,)))
        for op in (first, behind):
            started = time.monotonic()
            with pytest.raises(PeerFailure, match="rank 1 failed"):
                op.wait(5)
            assert time.monotonic() - started < 0.5
        other.wait(5)  # a new worker took the other channel
        late = TorchSend([fine], [np.zeros(64, np.uint8)], False, dead)
        dead.push(late)
        with pytest.raises(PeerFailure):
            late.wait(0.5)
        assert dead.backlog() == 0 and dead._queued_nbytes == 0  # nothing of it counts against the budget
        started = time.monotonic()
        workers.close(5)
        assert time.monotonic() - started < 0.5, "close must not wait for the worker gloo holds"
    finally:
        stuck.release.set()  # the let-go worker ends
