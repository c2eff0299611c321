"""Flow control of MPI point-to-point frames: a window per destination, opened by credits (pure).

MPI has no back-pressure on small messages: a sender's eager frames go out whether or not the
receiver has posted a receive, and where the fabric buffers them at the receiver (MPICH over OFI, as
between hosts) a rank that does not receive holds every frame sent to it, without limit. So each
sender keeps a :class:`SendWindow` per destination: at most :data:`WINDOW_FRAMES` frames and
:func:`window_nbytes` payload bytes that the receiver has not yet *taken* (its program received
them, or a posted receive matched them). A frame that does not fit waits at the sender.

The receiver tells each sender how many of its frames it has taken, on a communicator of its own:
a :class:`CreditCounter` per sender reports the running count after every :data:`CREDIT_FRAMES`
frames or :data:`CREDIT_NBYTES` bytes, whichever comes first (a few small messages per window, none
on a ping-pong's round trip). A receiver that has taken everything may still owe a report of less
than that, so a sender also posts whenever less than one report's worth is in flight
(:meth:`SendWindow.room`): a window never closes on frames the receiver already has.
"""

from __future__ import annotations

from collections import deque

__all__ = ["CREDIT_FRAMES", "CREDIT_NBYTES", "WINDOW_FRAMES", "WINDOW_MIN_NBYTES", "CreditCounter", "SendWindow",
           "window_nbytes"]

CREDIT_FRAMES = 256  # a receiver reports to a sender after taking this many of its frames ...
CREDIT_NBYTES = 1 << 20  # ... or this many of its payload bytes
WINDOW_FRAMES = 4 * CREDIT_FRAMES  # frames in flight to one destination, at most
WINDOW_MIN_NBYTES = 4 * CREDIT_NBYTES  # the smallest byte window, whatever the cap and the world size


def window_nbytes(cap: int, peers: int) -> int:
    """Payload bytes in flight to one destination: the receiver's cap (``POPMESH_P2P_BUFFER_BYTES``)
    shared by the ``peers`` ranks that may send to it, and at least :data:`WINDOW_MIN_NBYTES`."""
    return max(WINDOW_MIN_NBYTES, cap // max(1, peers))


class SendWindow:
    """What one sender has in flight to one destination: frames posted that the receiver has not
    reported as taken, with their sizes, oldest first."""

    __slots__ = ("_sizes", "credited", "in_flight", "limit_frames", "limit_nbytes", "sent")

    def __init__(self, limit_nbytes: int, limit_frames: int = WINDOW_FRAMES) -> None:
        self.limit_nbytes, self.limit_frames = limit_nbytes, limit_frames
        self.sent = self.credited = 0  # frames posted, frames the receiver reported taken (running counts)
        self.in_flight = 0  # payload bytes of the frames posted and not yet reported
        self._sizes: deque[int] = deque()

    def frames(self) -> int:
        """Frames posted and not yet reported taken."""
        return self.sent - self.credited

    def room(self, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` may be posted now: it fits the window, or less than one report's
        worth is in flight (the receiver may have taken all of it; a frame larger than the window
        goes this way too)."""
        frames = self.sent - self.credited
        if frames < self.limit_frames and self.in_flight + nbytes <= self.limit_nbytes:
            return True
        return frames < CREDIT_FRAMES and self.in_flight < CREDIT_NBYTES

    def admit(self, nbytes: int) -> bool:
        """Count a frame of ``nbytes`` as posted if there is :meth:`room` for it; whether there was."""
        frames, in_flight = self.sent - self.credited, self.in_flight  # room(), written out: every frame comes here
        if not ((frames < self.limit_frames and in_flight + nbytes <= self.limit_nbytes)
                or (frames < CREDIT_FRAMES and in_flight < CREDIT_NBYTES)):
            return False
        self.sent += 1
        self.in_flight += nbytes
        self._sizes.append(nbytes)
        return True

    def report_due(self) -> bool:
        """Whether a report may be waiting: a report's worth is in flight, so a receiver that took it
        has sent one. Taking reports as they come keeps them from lingering in MPI's queue, which
        slows MPICH's small messages (reports left there until a window filled cost a 4 B round trip
        about 30 %)."""
        return self.sent - self.credited >= CREDIT_FRAMES or self.in_flight >= CREDIT_NBYTES

    def credit(self, taken: int) -> None:
        """The receiver reports having taken ``taken`` frames in all (reports may come out of date)."""
        sizes = self._sizes
        while self.credited < taken and sizes:
            self.in_flight -= sizes.popleft()
            self.credited += 1


class CreditCounter:
    """What one receiver has taken from one sender, and when to tell it."""

    __slots__ = ("pending_frames", "pending_nbytes", "taken")

    def __init__(self) -> None:
        self.taken = 0  # frames taken in all
        self.pending_frames = self.pending_nbytes = 0  # taken since the last report

    def took(self, nbytes: int) -> int | None:
        """A frame of ``nbytes`` was taken; the running count to report now, or None."""
        self.taken += 1
        self.pending_frames += 1
        self.pending_nbytes += nbytes
        if self.pending_frames >= CREDIT_FRAMES or self.pending_nbytes >= CREDIT_NBYTES:
            self.pending_frames = self.pending_nbytes = 0
            return self.taken
        return None
