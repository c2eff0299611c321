"""The heartbeat's pure parts: the ring watch, the note codec, the settings (the thread itself runs
on real worlds in tests/world/test_failures.py)."""

import numpy as np
import pytest

from popmesh.core.errors import ConfigError
from popmesh.engines.liveness import (
    BEAT,
    BYE,
    DEFAULT_TIMEOUT_S,
    NOTICE,
    RingWatch,
    beat_interval,
    decode_note,
    encode_note,
    heartbeat_timeout,
    silence_text,
)


def test_a_silent_predecessor_is_found_after_the_timeout_and_only_once():
    watch = RingWatch(rank=0, size=4, timeout=5.0, started=100.0)
    assert (watch.predecessor, watch.successor) == (3, 1)
    assert watch.silent(104.0) is None
    watch.beat_from(2, 104.5)  # not its predecessor: no effect
    assert watch.silent(105.5) == pytest.approx(5.5)
    watch.beat_from(3, 105.6)
    assert watch.silent(110.0) is None and watch.silent(110.7) == pytest.approx(5.1)
    assert watch.record(3, "gone", 111.0) and not watch.record(3, "again", 112.0)
    assert not watch.record(0, "myself", 112.0)
    assert watch.predecessor == 2, "the watch moves to the live rank before the failed one"
    assert watch.silent(115.0) is None, "its silence counts from when the failure was known"
    watch.beat_from(2, 115.0)
    assert watch.silent(120.5) == pytest.approx(5.5)
    assert watch.record(2, "gone", 121.0) and watch.record(1, "gone", 121.0)
    assert watch.predecessor == 3 and watch.silent(1e6) is None, "a known failure is not found again"


def test_the_ring_closes_over_failed_ranks():
    watch = RingWatch(rank=1, size=5, timeout=1.0, started=0.0)
    watch.beat_from(0, 10.0)
    assert watch.record(2, "gone", 10.0) and watch.record(3, "gone", 10.0)
    assert (watch.predecessor, watch.successor) == (0, 4), "beats skip the failed ranks"
    assert watch.silent(10.5) is None and watch.silent(11.5) == pytest.approx(1.5), \
        "losing a rank that is not the predecessor does not reset the watch"


def test_a_predecessor_that_said_bye_is_not_watched():
    watch = RingWatch(rank=2, size=3, timeout=1.0, started=0.0)
    watch.bye_from(0)
    assert not watch.finished, "bye from another rank than the predecessor"
    watch.bye_from(1)
    assert watch.finished and watch.silent(1e6) is None


def test_every_run_of_failed_ranks_is_watched_by_a_live_rank():
    """The live rank right after a run of failed ranks watches the run's last member."""
    size = 7
    for failed in ({1}, {2, 3}, {0, 6}, {3, 4, 5, 6}):
        watchers = {RingWatch(r, size, 1.0, 0.0).predecessor for r in range(size) if r not in failed}
        assert watchers & failed, failed


def test_notes_round_trip_and_foreign_bytes_are_refused():
    for kind in (BEAT, BYE, NOTICE):
        assert decode_note(encode_note(kind, 3, 5, 21.25).view(np.uint8)) == (kind, 3, 5, 21.25)
    with pytest.raises(ConfigError, match="not a heartbeat"):
        decode_note(np.zeros(40, np.uint8))
    with pytest.raises(ConfigError, match="not a heartbeat"):
        decode_note(np.zeros(7, np.uint8))


def test_settings(monkeypatch):
    monkeypatch.delenv("POPMESH_HEARTBEAT_TIMEOUT", raising=False)
    assert heartbeat_timeout() == DEFAULT_TIMEOUT_S
    assert DEFAULT_TIMEOUT_S + beat_interval(DEFAULT_TIMEOUT_S) * 2 < 30, "found within 30 s by default"
    monkeypatch.setenv("POPMESH_HEARTBEAT_TIMEOUT", "0")
    assert heartbeat_timeout() == 0
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("POPMESH_HEARTBEAT_TIMEOUT", bad)
        with pytest.raises(ConfigError, match="POPMESH_HEARTBEAT_TIMEOUT"):
            heartbeat_timeout()
    assert beat_interval(2.0) == 0.1 and beat_interval(100.0) == 1.0
    assert "no heartbeat for 21.0 s" in silence_text(4, 21.0, 20.0) and "rank 4" in silence_text(4, 21.0, 20.0)
    assert "closed its connection" in silence_text(4, 0.0, 20.0)


class _Transport:
    """What the heartbeat reads of its point-to-point transport: rank 1 of 3, whose connection to rank 2
    reads as closed (gloo closed it with rank 0's, the failing rank's)."""

    rank, size = 1, 3

    def gone(self, rank):
        from popmesh.core.errors import PeerFailure

        if rank != 2:
            return None
        return PeerFailure("receiving from rank 2: Application timeout caused pair closure", (2,))

    def holding_back(self):
        return False

    def isend(self, note, dst, tag):
        return None


@pytest.mark.parametrize("told", [False, True])
def test_a_rank_told_of_a_failing_peer_names_no_other_from_its_closed_connections(monkeypatch, told):
    from popmesh.engines import liveness

    monkeypatch.setattr(liveness.failing, "take_down", lambda *args: None)  # the test process stays
    found = []
    heartbeat = liveness.Heartbeat(_Transport(), 20.0, lambda rank, error: found.append(rank))
    if told:
        heartbeat._failing(0, "ValueError: trainer 0 gives up")  # rank 0's note: this rank goes down with it
    else:
        heartbeat._failed(0, "rank 0 closed its connection (did it die?)")  # rank 0 died: the others carry on
    heartbeat._check_predecessor()  # the watch moved on to rank 2, whose connection reads as closed
    assert found == ([0] if told else [0, 2]) and sorted(heartbeat.errors()) == found
