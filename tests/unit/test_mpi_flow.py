"""The MPI transport's flow control as pure accounting: windows, credits, and the two promises they
make together (a bound on what is in flight, and no window ever closed on frames the receiver
already took). The MPI side is tested in tests/world (test_messages.py, scripts/p2p_window.py)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from popmesh.engines.mpi.flow import (
    CREDIT_FRAMES,
    CREDIT_NBYTES,
    WINDOW_FRAMES,
    WINDOW_MIN_NBYTES,
    CreditCounter,
    SendWindow,
    window_nbytes,
)


def test_the_receivers_cap_is_shared_by_its_senders_down_to_a_floor():
    assert window_nbytes(256 << 20, 1) == 256 << 20
    assert window_nbytes(256 << 20, 31) == (256 << 20) // 31
    assert window_nbytes(256 << 20, 1000) == WINDOW_MIN_NBYTES
    assert window_nbytes(0, 1) == WINDOW_MIN_NBYTES  # even a cap of 0 lets a sender post
    assert window_nbytes(256 << 20, 0) == 256 << 20  # a world of one


def test_a_window_fills_by_bytes_and_opens_by_credits():
    w = SendWindow(8 << 20)
    for _ in range(8):
        assert w.admit(1 << 20)
    assert not w.room(1) and w.frames() == 8 and w.in_flight == 8 << 20
    w.credit(3)
    assert w.frames() == 5 and w.in_flight == 5 << 20 and w.room(3 << 20) and not w.room((3 << 20) + 1)
    w.credit(2)  # a report older than one already applied changes nothing
    assert w.frames() == 5
    w.credit(100)  # more than was sent (a receiver restarted its count): everything is taken
    assert w.frames() == 0 and w.in_flight == 0


def test_a_window_fills_by_frames_whatever_their_size():
    w = SendWindow(1 << 30)
    for _ in range(WINDOW_FRAMES):
        assert w.admit(4)
    assert not w.room(0) and not w.admit(0) and w.frames() == WINDOW_FRAMES
    w.credit(1)
    assert w.room(4)


def test_a_frame_larger_than_the_window_goes_once_less_than_a_report_is_in_flight():
    w = SendWindow(WINDOW_MIN_NBYTES)
    assert w.admit(64 << 20)  # nothing in flight
    assert not w.room(1)  # 64 MiB in flight: wait for the receiver
    w.credit(1)
    assert w.admit(CREDIT_NBYTES - 1)
    assert w.room(64 << 20)  # the receiver may have taken it without owing a report yet
    assert w.admit(1)
    assert not w.room(64 << 20)  # a report's worth in flight: the receiver owes one if it took it


@pytest.mark.parametrize("sizes, every", [([4] * (3 * CREDIT_FRAMES), CREDIT_FRAMES),
                                          ([CREDIT_NBYTES // 4] * 12, 4)])
def test_a_receiver_reports_after_a_credits_worth_of_frames_or_bytes(sizes, every):
    counter = CreditCounter()
    reports = [counter.took(n) for n in sizes]
    assert [r for r in reports if r is not None] == list(range(every, len(sizes) + 1, every))
    assert counter.taken == len(sizes)


@pytest.mark.parametrize("seed", range(20))
def test_bounded_and_never_stuck_on_frames_already_taken(seed):
    """A sender and a receiver that takes frames in order at a random pace, with credits delivered
    late: what is in flight stays within the window (or under a report's worth plus one frame), and
    whenever the receiver has taken everything posted and every credit has arrived, the next frame
    may go: the window cannot deadlock a receiver that receives."""
    rng = random.Random(seed)
    limit = WINDOW_MIN_NBYTES
    window, counter = SendWindow(limit), CreditCounter()
    sizes = [rng.choice([4, 1 << 10, 1 << 16, 1 << 20, 3 << 20, 9 << 20]) for _ in range(3000)]
    posted: deque[int] = deque()  # frames in MPI, not yet taken
    credits: deque[int] = deque()  # reports sent, not yet applied
    taken_bytes = sent_bytes = 0
    queue = deque(sizes)
    while queue or posted:
        if queue and window.admit(queue[0]):
            n = queue.popleft()
            posted.append(n)
            sent_bytes += n
            frames, held = window.frames(), window.in_flight
            assert (frames <= WINDOW_FRAMES and held <= limit) or (frames <= CREDIT_FRAMES and held < CREDIT_NBYTES + n)
            continue
        if posted and rng.random() < 0.7:
            n = posted.popleft()
            taken_bytes += n
            report = counter.took(n)
            if report is not None:
                credits.append(report)
        elif credits:
            window.credit(credits.popleft())
        elif queue and not posted:
            raise AssertionError(f"stuck: {window.frames()} frames in flight, all taken, every credit applied")
        else:
            window.credit(0)
    assert taken_bytes == sent_bytes == sum(sizes)


def test_a_report_is_due_once_a_reports_worth_is_in_flight():
    by_frames, by_bytes = SendWindow(1 << 30), SendWindow(1 << 30)
    for _ in range(CREDIT_FRAMES - 1):
        by_frames.admit(4)
    by_bytes.admit(CREDIT_NBYTES - 1)
    assert not by_frames.report_due() and not by_bytes.report_due()
    by_frames.admit(4)
    by_bytes.admit(1)
    assert by_frames.report_due() and by_bytes.report_due()
    by_frames.credit(CREDIT_FRAMES)
    assert not by_frames.report_due()
