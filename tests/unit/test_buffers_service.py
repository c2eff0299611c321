"""The replay-buffer service without processes: protocol, baselines, store, dispatch, and the whole
protocol in a world of one (trainer, manager and coordinator are rank 0, the service loops run in threads)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

import popmesh
from popmesh import ConfigError
from popmesh.buffers import (
    Coordinator,
    LocalStore,
    ReplayBufferClient,
    ReplayBufferManager,
    ServiceError,
    novelty_score,
)
from popmesh.buffers import baselines as bl
from popmesh.buffers.protocol import (
    COORDINATOR_TAG,
    HEADER_KEY,
    METADATA_TAG,
    REQUEST_TAG,
    SCORE_TAG,
    STATS_TAG,
    Message,
    MessageType,
    ProtocolError,
    from_payload,
    to_payload,
)
from popmesh.buffers.store import concat_batches, select_rows
from popmesh.wire import decode, encode


def batch(x, rewards=None):
    x = np.asarray(x, np.float32).reshape(-1, 1)
    r = np.zeros(len(x)) if rewards is None else np.asarray(rewards, float)
    return {"states": x, "log_rewards": r}


# ---- protocol ----------------------------------------------------------------------------------

def test_message_round_trips_through_the_wire_without_pickle():
    msg = Message(MessageType.DATA, {"rows": 2, "note": "é"}, batch([1, 2], [-1, -np.inf]))
    back = from_payload(decode(encode(to_payload(msg))))
    assert back.type is MessageType.DATA and back.data == msg.data
    assert back.batch["states"].tolist() == [[1], [2]] and back.batch["log_rewards"][1] == -np.inf
    assert from_payload(to_payload(Message(MessageType.EXIT))) == Message(MessageType.EXIT, {}, None)


@pytest.mark.parametrize("payload", [
    b"bytes", [1], {"x": np.ones(2)}, {HEADER_KEY: np.frombuffer(b"{not json", np.uint8)},
    {HEADER_KEY: np.frombuffer(b'{"v":1,"type":"NOPE","data":{}}', np.uint8)},
    {HEADER_KEY: np.frombuffer(b'{"v":9,"type":"EXIT","data":{}}', np.uint8)},
    {HEADER_KEY: np.frombuffer(b'{"v":1,"type":"EXIT","data":[]}', np.uint8)},
    {HEADER_KEY: np.frombuffer(b'{"v":1,"type":"DATA","data":{}}', np.uint8), "a": np.ones(2), "b": np.ones(3)},
])
def test_malformed_payloads_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        from_payload(payload)


@pytest.mark.parametrize("bad", [{}, {"__x": np.ones(2)}, {"a": np.float64(1.0)}, {"a": np.ones(2), "b": np.ones(3)}])
def test_bad_batches_and_data_are_refused_by_the_sender(bad):
    with pytest.raises(ProtocolError):
        to_payload(Message(MessageType.DATA, {}, bad))
    with pytest.raises(ProtocolError):
        to_payload(Message(MessageType.SCORE, {"x": {1, 2}}))


# ---- baselines ---------------------------------------------------------------------------------

def test_strategy_validation():
    with pytest.raises(ConfigError):
        bl.check_strategy("max", 0.1, 0.1)
    with pytest.raises(ConfigError):
        bl.check_strategy("percentile", 1.5, 0.1)
    with pytest.raises(ConfigError):
        bl.check_strategy("ema", 0.1, 0.0)


def test_ema_of_batch_minima_ignores_non_finite():
    assert bl.update_ema(None, [-np.inf, -np.inf], 0.5) is None
    assert bl.update_ema(None, [-1.0, -3.0, -np.inf], 0.5) == -3.0
    assert bl.update_ema(-3.0, [-1.0, np.nan], 0.5) == -2.0


def test_local_baseline_min_percentile_and_fallback():
    rewards = np.arange(5.0)
    assert bl.local_baseline("min", rewards, True, -9.0) == 0.0
    assert bl.local_baseline("percentile", rewards, True, -9.0, percentile=0.5) == 2.0
    assert bl.local_baseline("min", rewards, False, -9.0) == -9.0
    assert bl.local_baseline("percentile", None, True, -9.0) == -9.0
    assert bl.local_baseline("ema", rewards, True, -9.0) == -9.0
    assert bl.choose_baseline(-7.5, 0.0) == -7.5 and bl.choose_baseline(None, 0.0) == 0.0


def test_reduce_baselines_and_keep_mask():
    assert bl.reduce_baselines([None, -1.0, -3.0, math.inf], "min") == -3.0
    assert bl.reduce_baselines([-1.0, -3.0], "mean") == -2.0 and bl.reduce_baselines([-1.0, -3.0], "max") == -1.0
    assert bl.reduce_baselines([None], "min") is None
    with pytest.raises(ConfigError):
        bl.reduce_baselines([], "median")
    assert bl.keep_mask([-1.0, 0.0, 1.0], 0.0).tolist() == [False, True, True]
    assert bl.keep_mask([-1.0], None).tolist() == [True]


# ---- store -------------------------------------------------------------------------------------

def test_store_is_a_bounded_fifo_of_rows():
    store = LocalStore(5)
    assert store.add(batch([1, 2, 3])) == 0 and not store.is_full
    assert store.add(batch([4, 5, 6])) == 1 and store.is_full
    assert store.column("states").ravel().tolist() == [2, 3, 4, 5, 6]
    assert store.add(batch(range(10, 17))) == 5 and store.column("states").ravel().tolist() == [12, 13, 14, 15, 16]
    with pytest.raises(ConfigError):
        store.add({"other": np.ones(1)})
    with pytest.raises(ConfigError):
        LocalStore(0)
    assert LocalStore(2).column("states") is None


def test_concat_and_select_numpy_and_torch():
    joined = concat_batches([batch([1]), batch([2, 3])])
    assert joined["states"].ravel().tolist() == [1, 2, 3]
    tb = {"x": torch.arange(4), "y": np.arange(4)}
    picked = select_rows(tb, np.array([True, False, True, False]))
    assert picked["x"].tolist() == [0, 2] and picked["y"].tolist() == [0, 2]
    assert concat_batches([{"x": torch.ones(1)}, {"x": torch.zeros(2)}])["x"].tolist() == [1, 0, 0]
    with pytest.raises(ConfigError):
        concat_batches([{"x": np.ones(1)}, {"y": np.ones(1)}])


# ---- manager and coordinator dispatch ----------------------------------------------------------

def test_manager_scores_before_inserting():
    mgr = ReplayBufferManager([1], scoring_function=novelty_score("states"))
    first = mgr.handle(1, Message(MessageType.DATA, {}, batch([1, 2])))
    again = mgr.handle(1, Message(MessageType.DATA, {}, batch([1, 2])))
    near = mgr.handle(1, Message(MessageType.DATA, {}, batch([4])))
    assert [o.message.data["score"] for o in (first[0], again[0], near[0])] == [math.inf, 0.0, 2.0]
    assert first[0].dst == 1 and first[0].tag == SCORE_TAG and first[0].message.type is MessageType.SCORE
    assert again[0].message.data["stored"] == 4 and mgr.stats.rows_from[1] == 5


def test_manager_baselines_sync_and_reports():
    mgr = ReplayBufferManager([0, 1], capacity=4, coordinator_rank=9, report_every=2,
                              scoring_function=lambda b, s: {"score": 1.0, "modes": ["a"]})
    out = mgr.handle(0, Message(MessageType.DATA, {}, batch([1, 2], [-5.0, -1.0])))
    assert [o.message.type for o in out] == [MessageType.SCORE, MessageType.MODE_REPORT]
    assert out[1].dst == 9 and out[1].tag == COORDINATOR_TAG
    assert out[1].message.data == {"modes": ["a"], "training_rank": 0}
    assert out[0].message.data["baseline"] == -5.0  # EMA while not full
    out = mgr.handle(1, Message(MessageType.DATA, {}, batch([3, 4], [-2.0, -3.0])))
    assert out[-1].message.type is MessageType.BASELINE_REPORT and out[-1].message.data["baseline"] == -5.0  # full: min
    assert mgr.handle(9, Message(MessageType.BASELINE_SYNC, {})) == [] and mgr.baseline == -5.0  # no value: ignored
    assert mgr.handle(9, Message(MessageType.BASELINE_SYNC, {"global_baseline": -7.5})) == []
    assert mgr.baseline == -7.5 and mgr.local_baseline == -5.0
    assert mgr.handle(0, Message(MessageType.BASELINE_SYNC, {"global_baseline": 1.0}))[0].message.type is \
        MessageType.ERROR and mgr.baseline == -7.5


def test_manager_errors_exit_and_metadata():
    mgr = ReplayBufferManager([0, 1], metadata_function=lambda store: {"custom": len(store)})
    bad = mgr.handle(0, Message(MessageType.MODE_REPORT, {}))
    assert bad[0].message.type is MessageType.ERROR and bad[0].tag == SCORE_TAG and mgr.stats.errors == 1
    meta = mgr.handle(1, Message(MessageType.GET_METADATA))[0]
    assert meta.tag == METADATA_TAG and meta.message.data["custom"] == 0 and meta.message.data["capacity"] == 10000
    assert mgr.handle(5, Message(MessageType.EXIT))[0].message.type is MessageType.ERROR  # not served
    assert "without a batch" in mgr.handle(0, Message(MessageType.DATA))[0].message.data["error"]
    mgr.handle(0, Message(MessageType.EXIT))
    assert not mgr.done
    mgr.handle(1, Message(MessageType.EXIT))
    assert mgr.done and mgr.stats.to_dict()["messages"]["EXIT"] == 3 and mgr.stats.errors == 3
    no_score = ReplayBufferManager([0], scoring_function=lambda b, s: {"value": 1})
    refused = no_score.handle(0, Message(MessageType.DATA, {}, batch([1])))[0].message
    assert refused.type is MessageType.ERROR and "must include 'score'" in refused.data["error"]
    with pytest.raises(ConfigError):
        ReplayBufferManager([0], baseline_strategy="max")


def _picky(b, store):
    """Scores like novelty_score, but raises on negative states (a scoring function with a bug)."""
    if (np.asarray(b["states"]) < 0).any():
        raise ValueError("negative states")
    return novelty_score("states")(b, store)


def _state(mgr):
    return len(mgr.store), dict(mgr.stats.rows_from), mgr.local_baseline, mgr._data_seen


@pytest.mark.parametrize(("bad", "cause"), [
    ({"states": np.ones((2, 3), np.float32), "log_rewards": np.zeros(2)}, "rows of shape (3,)"),  # the issue
    ({"states": np.array([["a"], ["b"]]), "log_rewards": np.zeros(2)}, "dtype <U1"),
    ({"other": np.ones((2, 1))}, "batch keys ['other'] differ"),
    (batch([-1.0]), "DATA from rank 0 refused: ValueError: negative states"),
])
def test_a_bad_batch_is_refused_whole_and_the_manager_goes_on(bad, cause):
    mgr = ReplayBufferManager([0, 1], capacity=8, scoring_function=_picky, coordinator_rank=9)
    assert mgr.handle(1, Message(MessageType.DATA, {}, batch([1, 2], [-1.0, -2.0])))[0].message.type is \
        MessageType.SCORE
    before = _state(mgr)
    out = mgr.handle(0, Message(MessageType.DATA, {}, bad))
    assert [(o.dst, o.tag, o.message.type) for o in out] == [(0, SCORE_TAG, MessageType.ERROR)]
    assert cause in out[0].message.data["error"] and out[0].message.data["request"] == "DATA", out
    assert _state(mgr) == before and mgr.stats.errors == 1  # neither stored, scored into the baseline, nor counted
    good = mgr.handle(0, Message(MessageType.DATA, {}, batch([4], [-1.0])))
    assert good[0].message.type is MessageType.SCORE and good[0].message.data["score"] == 2.0
    assert dict(mgr.stats.rows_from) == {1: 2, 0: 1} and len(mgr.store) == 3


def test_unserved_ranks_and_failing_user_functions_get_errors_on_the_channel_they_wait_on():
    def broken_metadata(store):
        raise RuntimeError("metadata bug")

    mgr = ReplayBufferManager([0], metadata_function=broken_metadata,
                              scoring_function=lambda b, s: {"score": 1.0, "extra": np.float32(1)})
    for kind, tag in ((MessageType.DATA, SCORE_TAG), (MessageType.GET_METADATA, METADATA_TAG),
                      (MessageType.EXIT, SCORE_TAG)):
        out = mgr.handle(3, Message(kind, {}, batch([1]) if kind is MessageType.DATA else None))
        assert [(o.dst, o.tag, o.message.type) for o in out] == [(3, tag, MessageType.ERROR)], out
        assert "does not serve it (it serves ranks [0])" in out[0].message.data["error"]
    meta = mgr.handle(0, Message(MessageType.GET_METADATA))[0]
    assert meta.tag == METADATA_TAG and meta.message.type is MessageType.ERROR
    assert "RuntimeError: metadata bug" in meta.message.data["error"]
    score = mgr.handle(0, Message(MessageType.DATA, {}, batch([1])))[0].message  # a float32 extra: not JSON-able
    assert score.type is MessageType.ERROR and "JSON-able" in score.data["error"] and len(mgr.store) == 0
    assert mgr.stats.errors == 5 and not mgr.exited and sum(mgr.stats.rows_from.values()) == 0


def test_coordinator_aggregates_and_syncs():
    coord = Coordinator([2, 5])
    coord.handle(2, Message(MessageType.MODE_REPORT, {"modes": ["a", "b"], "training_rank": 0}))
    coord.handle(5, Message(MessageType.MODE_REPORT, {"modes": ["b", "c"], "training_rank": 3}))
    assert coord.modes == {"a", "b", "c"} and dict(coord.modes_by_rank) == {0: 2, 3: 1}
    sync = coord.handle(2, Message(MessageType.BASELINE_REPORT, {"baseline": -1.0}))
    assert [(o.dst, o.tag, o.message.data["global_baseline"]) for o in sync] == [(2, REQUEST_TAG, -1.0),
                                                                                 (5, REQUEST_TAG, -1.0)]
    assert coord.handle(5, Message(MessageType.BASELINE_REPORT, {"baseline": 0.0})) == []  # the min is unchanged
    ack = coord.handle(5, Message(MessageType.EXIT))
    assert ack[0].message.type is MessageType.EXIT_ACK and ack[0].dst == 5 and not coord.done
    assert [o.dst for o in coord.handle(2, Message(MessageType.BASELINE_REPORT, {"baseline": -4.0}))] == [2]
    stats = coord.handle(0, Message(MessageType.GET_POPULATION_STATS))[0]
    assert stats.tag == STATS_TAG and stats.message.data["modes_found"] == 3
    assert stats.message.data["global_baseline"] == -4.0 and stats.message.data["active_managers"] == [2]
    assert coord.handle(0, Message(MessageType.DATA))[0].message.type is MessageType.ERROR
    assert coord.handle(2, Message(MessageType.GET_METADATA)) == []  # managers get no error replies
    coord.handle(2, Message(MessageType.EXIT))
    assert coord.done and coord.errors == 2


# ---- the whole protocol in a world of one ------------------------------------------------------

class Service:
    """A manager (serving rank 0) and a coordinator running in threads of this world of one."""

    def __init__(self, scoring_function=None) -> None:
        popmesh.init("local")
        self.results = {}
        self.manager = ReplayBufferManager([0], capacity=6, coordinator_rank=0, timeout=10,
                                           scoring_function=scoring_function or novelty_score("states"))
        self.coordinator = Coordinator([0], timeout=10)
        self.threads = [
            threading.Thread(target=lambda: self.results.setdefault("manager", self.manager.run(idle_timeout=20))),
            threading.Thread(target=lambda: self.results.setdefault("final", self.coordinator.run(idle_timeout=20)))]
        for t in self.threads:
            t.start()

    def join(self) -> dict:
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "the service loops must end after drain()"
        return self.results


def test_sync_mode_with_filtering():
    service = Service()
    c = ReplayBufferClient(0, coordinator_rank=0, baseline_filtering=True, baseline_refresh_after=2, timeout=10)
    assert c.add(batch([1, 2], [-1.0, -2.0]))["score"] == math.inf and c.baseline == -2.0
    assert c.add(batch([1, 5], [-9.0, 0.0]))["rows"] == 1  # -9 is below the baseline
    assert c.add(batch([7], [-9.0])) is None and c.skipped == 1
    assert c.add(batch([8], [-9.0]))["rows"] == 1  # second skip in a row: sent whole to refresh the baseline
    assert c.get_metadata()["stored"] == 4 and c.population_stats()["active_managers"] == [0]
    assert c.drain()["rows"] == 1 and c.drain() is c.last_score
    results = service.join()
    assert results["manager"].messages["DATA"] == 3 and results["manager"].messages["EXIT"] == 1
    assert results["final"]["active_managers"] == [] and results["final"]["global_baseline"] is not None


@pytest.mark.parametrize("mode", ["async-score", "async-comm"])
def test_async_modes_return_the_previous_score(mode):
    service = Service()
    c = ReplayBufferClient(0, mode=mode, remote_every=2, timeout=10)
    assert c.add(batch([1])) is None
    assert c.add(batch([2])) is None  # sends [1, 2]; no earlier score to return
    assert c.add(batch([1])) is None  # remote_every=2: nothing sent
    previous = c.add(batch([2]))  # collects the first score, sends [1, 2] again
    assert previous["rows"] == 2 and previous["score"] == math.inf
    assert c.drain()["score"] == 0.0  # the second copy scored against the first
    assert service.join()["manager"].messages["DATA"] == 2


def test_refused_batches_raise_service_error_and_lose_nothing_after_them():
    service = Service(_picky)
    c = ReplayBufferClient(0, mode="async-comm", timeout=10)
    assert c.add(batch([1])) is None
    assert c.add(batch([-1]))["score"] == math.inf  # the previous score; the refused batch is in flight
    with pytest.raises(ServiceError, match="negative states") as refused:
        c.add(batch([2]))  # collects the ERROR, but sends its own batch first
    assert (refused.value.rank, refused.value.request) == (0, "DATA")
    assert c.add(batch([4]))["score"] == 1.0  # [2] arrived: scored against [1]
    sync = ReplayBufferClient(0, timeout=10)  # a second client of the same rank, to refuse in sync mode
    with pytest.raises(ServiceError, match="rows of shape"):
        sync.add({"states": np.ones((1, 2), np.float32), "log_rewards": np.zeros(1)})
    assert c.get_metadata()["stored"] == 3
    with pytest.raises(ServiceError, match="negative states"):
        c.add(batch([-5]))  # [4]'s score is fine; [-5] is refused, which drain() reports
        c.drain()
    results = service.join()  # EXIT went out all the same: the service ended
    assert results["manager"].errors == 3 and dict(results["manager"].rows_from) == {0: 3}
    assert results["manager"].messages["DATA"] == 6 and results["manager"].messages["EXIT"] == 1


def test_local_only_client_and_misuse():
    popmesh.init("local")
    c = ReplayBufferClient(None, capacity=3)
    assert c.add(batch([1, 2])) is None and c.add(batch([3, 4])) is None and len(c.local) == 3
    assert c.drain() is None
    with pytest.raises(ConfigError):
        c.add(batch([1]))
    with pytest.raises(ConfigError):
        ReplayBufferClient(None, baseline_filtering=True)
    with pytest.raises(ConfigError):
        ReplayBufferClient(0, mode="eager")
    with pytest.raises(ConfigError):
        ReplayBufferClient(None).get_metadata()


def test_a_batch_sent_again_after_a_reform_is_answered_again_but_stored_once():
    """A client resends the DATA whose score it never saw (seq unchanged): the manager replies with the
    same score, marked repeated, and neither stores nor counts the rows twice; a newer seq is stored."""
    manager = ReplayBufferManager([0], capacity=100, scoring_function=novelty_score("states"))
    batch = {"states": np.ones((3, 2), np.float32), "log_rewards": np.zeros(3)}

    def data(seq):
        return Message(MessageType.DATA, {"rows": 3, "seq": seq, "client": "a"}, batch)

    first = manager.handle(0, data(1))[0].message.data
    again = manager.handle(0, data(1))[0].message.data
    assert again == {**first, "repeated": True} and len(manager.store) == 3 and manager.stats.rows_from[0] == 3
    assert manager.stats.repeated == 1
    assert "repeated" not in manager.handle(0, data(2))[0].message.data and len(manager.store) == 6
    assert manager.handle(0, data(1))[0].message.data["repeated"]  # anything older is a repeat too
    other = Message(MessageType.DATA, {"rows": 3, "seq": 1, "client": "b"}, batch)  # another client of rank 0
    assert "repeated" not in manager.handle(0, other)[0].message.data and len(manager.store) == 9
