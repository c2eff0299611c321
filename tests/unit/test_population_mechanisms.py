"""Unit tests of the population mechanisms' local and pure parts: model state, options, replacement,
the async protocol's bookkeeping, event logs, and every policy in a world of one."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from popmesh.comm.messages import POPULATION_TAGS
from popmesh.core.errors import ConfigError, PopmeshError
from popmesh.population import (
    AsyncSelectiveAveraging,
    AverageAll,
    Decision,
    DonorRule,
    EventLog,
    Explore,
    OneSidedAveraging,
    PolicyInfo,
    ReplacementRule,
    SelectiveAveraging,
    SelectiveOptions,
    decide,
)
from popmesh.population.mechanisms.asynchronous.protocol import (
    ACK,
    BYE,
    MAX_INSTANCES,
    METRIC,
    CoordinatorBook,
    channels,
    decision_messages,
    involved,
    parse_up,
    recipients_of,
    up_row,
)
from popmesh.population.mechanisms.selective import combination_groups
from popmesh.population.state.model_state import (
    Layout,
    layout_of,
    load_,
    load_optimizer_tensors_,
    model_tensors,
    optimizer_tensors,
    pack_bytes,
    refresh_,
    snapshot,
    to_numpy,
    unpack_bytes,
)
from popmesh.population.state.replace import apply_replacement

SPECS = st.lists(st.tuples(st.sampled_from(["float32", "float64", "float16", "bfloat16", "int64"]),
                           st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=8)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Parameter(torch.arange(4, dtype=torch.float64))
        self.c = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        self.norm = nn.BatchNorm1d(2)


# ---- layouts and model state ------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(SPECS)
def test_layout_packs_each_dtype_contiguously_and_aligned(specs):
    layout = Layout.from_specs([(f"t{i}", dt, shape) for i, (dt, shape) in enumerate(specs)])
    table = layout.byte_table()
    spans = sorted(table.values())
    assert all(start % 8 == 0 for start, _ in spans)
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans)), "buffers must not overlap"
    for dt in layout.dtypes:
        entries = [e for e in layout.entries if e.dtype == dt]
        assert [e.offset for e in entries] == list(np.cumsum([0] + [e.numel for e in entries])[:-1])
    assert layout.nbytes >= sum(n for _, n in spans)


def test_fingerprint_tells_layouts_apart_and_fits_a_float64():
    one = Layout.from_specs([("w", "float32", (2, 3))])
    assert one.fingerprint() == Layout.from_specs([("w", "float32", (2, 3))]).fingerprint()
    assert one.fingerprint() != Layout.from_specs([("w", "float32", (3, 2))]).fingerprint()
    assert one.fingerprint() != Layout.from_specs([("w", "float64", (2, 3))]).fingerprint()
    assert float(one.fingerprint()) == one.fingerprint() and one.fingerprint() < 2**52
    with pytest.raises(ConfigError, match="cannot move"):
        Layout.from_specs([("s", "str", ())])


def test_snapshot_is_a_copy_and_load_writes_back_in_place():
    model = Mixed()
    tensors = model_tensors(model, include_buffers=True)
    assert "buffer:norm.running_mean" in tensors and "buffer:norm.num_batches_tracked" not in tensors
    flat = snapshot(tensors)
    assert set(flat.buffers) == {"float32", "float64", "bfloat16"}
    with torch.no_grad():
        model.b.add_(10)
    assert float(flat.buffers["float64"][0]) == 0.0, "a snapshot must not follow the live tensor"
    ident = id(model.b)
    load_(tensors, flat)
    assert id(model.b) == ident and torch.equal(model.b, torch.arange(4, dtype=torch.float64))


def test_snapshot_packs_interleaved_dtypes_in_layout_order_and_refresh_reuses_its_buffers():
    model = Mixed()  # float32 (a.weight, a.bias), float64 (b), bfloat16 (c), float32 again (norm)
    tensors = model_tensors(model, include_buffers=True)
    layout = layout_of(tensors)
    flat = snapshot(tensors, layout)
    for e in layout.entries:
        got = flat.buffers[e.dtype][e.offset:e.offset + e.numel]
        assert torch.equal(got, tensors[e.name].detach().reshape(-1)), e.name
    assert not any(b.requires_grad for b in flat.buffers.values()), "a snapshot must not hold an autograd graph"
    assert layout.names_by_dtype["float32"][-1] == "buffer:norm.running_var"
    before = {dt: b.data_ptr() for dt, b in flat.buffers.items()}
    with torch.no_grad():
        model.a.weight.fill_(7.0)
    refresh_(flat, tensors)
    assert {dt: b.data_ptr() for dt, b in flat.buffers.items()} == before
    assert torch.equal(flat.buffers["float32"][:6], torch.full((6,), 7.0))
    assert layout.fingerprint() == layout_of(model_tensors(Mixed(), include_buffers=True)).fingerprint()


def test_pack_and_unpack_bytes_round_trip_mixed_dtypes():
    model = Mixed()
    flat = snapshot(model_tensors(model))
    raw = np.zeros(flat.layout.nbytes, dtype=np.uint8)
    pack_bytes(flat, raw)
    back = unpack_bytes(flat.layout, raw)
    ref = to_numpy(flat)
    assert set(back) == set(ref)
    for dt in ref:
        assert np.array_equal(back[dt], ref[dt]), dt
    assert back["bfloat16"].dtype == np.float32


def test_optimizer_state_round_trip_keeps_own_hyper_parameters():
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = optimizer_tensors(opt)
    assert "0/exp_avg" in state and "0/step" in state
    other = torch.optim.Adam(Mixed().parameters(), lr=0.5)
    load_optimizer_tensors_(other, state)
    assert other.param_groups[0]["lr"] == 0.5
    assert torch.allclose(other.state_dict()["state"][0]["exp_avg"], state["0/exp_avg"])
    with pytest.raises(ConfigError, match="index"):
        load_optimizer_tensors_(other, {"bad": torch.zeros(1)})


# ---- options and local replacement -----------------------------------------------------------
def test_options_are_checked_at_construction():
    with pytest.raises(ConfigError, match="model_builder"):
        SelectiveOptions(5, strategy="reset_weights")
    with pytest.raises(ConfigError, match="momentum"):
        SelectiveOptions(5, momentum=1.0)
    with pytest.raises(ConfigError, match="every"):
        SelectiveOptions(0)
    with pytest.raises(ConfigError, match="strategy"):
        SelectiveOptions(5, strategy="median")
    with pytest.raises(ConfigError, match="ReplacementRule"):
        SelectiveOptions(5, rule=0.25)
    with pytest.raises(ConfigError, match="Explore"):
        Explore(keys=())
    assert SelectiveOptions(5).rule == ReplacementRule(ratio=0.25)
    with pytest.raises(ConfigError, match=r"unknown options \['ratio'\]; valid: \['rule'"):
        SelectiveAveraging(every=5, ratio=0.2)


def test_explore_is_deterministic_per_rank_and_iteration():
    def lr_after(rank, iteration):
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        Explore(resample_prob=0.0).apply(opt, seed=1, iteration=iteration, rank=rank)
        return opt.param_groups[0]["lr"]

    assert lr_after(3, 10) == lr_after(3, 10) and lr_after(3, 10) in (0.8, 1.2)
    assert len({lr_after(r, it) for r in range(6) for it in range(4)}) == 2
    with pytest.raises(ConfigError, match="not optimizer hyper-parameters"):
        Explore(keys=("beta9",)).apply(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0), 0, 0, 0)


def _filled(value):
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_apply_replacement_momentum_and_optimizer_policies():
    model = _filled(1.0)
    layout = layout_of(model_tensors(model))
    combined = {"float32": np.full(layout.numel("float32"), 5.0, dtype=np.float32)}
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    applied = apply_replacement(SelectiveOptions(1, momentum=0.25, optimizer_policy="keep"), model, opt, combined,
                                iteration=0, rank=0)
    assert applied.optimizer_text == "keep" and opt.state_dict()["state"]
    assert all(torch.allclose(p, torch.full_like(p, 0.25 + 0.75 * 5)) for p in model.parameters())
    applied = apply_replacement(SelectiveOptions(1), model, opt, combined, iteration=0, rank=0)
    assert applied.optimizer is opt and applied.optimizer_text == "reset" and not opt.state_dict()["state"]
    empty = apply_replacement(SelectiveOptions(1, optimizer_policy="copy"), model, opt, combined, iteration=0,
                              rank=0, donor_state={}, source=2)
    assert empty.optimizer_text == "reset (rank 2 had no optimizer state to copy)"
    built = apply_replacement(SelectiveOptions(1, optimizer_builder=lambda m: torch.optim.SGD(m.parameters(), 0.1)),
                              model, opt, combined, iteration=0, rank=0)
    assert isinstance(built.optimizer, torch.optim.SGD) and built.optimizer_text == "rebuilt"
    fresh = apply_replacement(SelectiveOptions(1, strategy="reset_weights", model_builder=lambda: _filled(-3.0)),
                              model, None, None, iteration=0, rank=0)
    assert fresh.optimizer is None and all(torch.all(p == -3.0) for p in model.parameters())
    with pytest.raises(ConfigError, match="same architecture"):
        apply_replacement(SelectiveOptions(1, strategy="reset_weights", model_builder=lambda: nn.Linear(3, 3)),
                          model, None, None, iteration=0, rank=0)


# ---- synchronous plan --------------------------------------------------------------------------
def test_replaced_ranks_with_the_same_donors_share_one_transfer():
    metrics = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    d = decide(metrics, ReplacementRule(ratio=0.5))
    assert combination_groups(d) == [((3, 4, 5), (1 / 3, 1 / 3, 1 / 3), (0, 1, 2))]
    rnd = decide(metrics, ReplacementRule(ratio=0.5), DonorRule("random", k=1), rng=3)
    groups = combination_groups(rnd)
    assert sorted(r for g in groups for r in g[2]) == [0, 1, 2]
    assert all(len(g[0]) == 1 for g in groups)
    assert combination_groups(decide(metrics, ReplacementRule(ratio=0.5), strategy="reset_weights")) == []


# ---- asynchronous protocol ---------------------------------------------------------------------
def test_channels_are_distinct_internal_tags():
    tags = [t for i in range(MAX_INSTANCES) for t in vars(channels(i)).values()]
    assert len(set(tags)) == len(tags) and all(t in POPULATION_TAGS for t in tags)
    with pytest.raises(ConfigError, match="channel"):
        channels(MAX_INSTANCES)


def test_up_rows_round_trip_with_nan():
    up = parse_up(up_row(METRIC, 40, math.nan, 2**51 + 3, acked=30, steps=2**52 + 1, generation=2))
    assert (up.kind, up.iteration, up.fingerprint, up.acked) == (METRIC, 40, 2**51 + 3, 30) and math.isnan(up.metric)
    assert (up.steps, up.generation) == (2**52 + 1, 2)
    assert parse_up(up_row(BYE, -1)).acked == -1, "no acknowledgement by default"
    with pytest.raises(ConfigError, match="mixed popmesh versions"):
        parse_up(np.zeros(4))


def test_each_decision_goes_to_every_rank_it_involves_and_no_other():
    metrics = [1.0, 4.0, 2.0, 3.0]
    assert involved(decide(metrics, ReplacementRule(ratio=0.25))) == [0, 1, 2, 3]
    assert involved(decide(metrics, ReplacementRule(ratio=0.25), strategy="best_only")) == [0, 1]
    assert involved(decide(metrics, ReplacementRule(ratio=0.5), strategy="reset_weights")) == [0, 2]
    assert involved(decide(metrics, ReplacementRule(threshold=0.0))) == [], "nobody below the threshold"


@pytest.mark.parametrize("donor_rule, strategy", [
    (DonorRule("all"), "mean"), (DonorRule("best_k", 2), "weighted_mean"), (DonorRule("random", 3), "mean"),
    (DonorRule("best_k", 2), "best_only"), (DonorRule("all"), "reset_weights"),
])
def test_each_rank_gets_its_part_of_a_decision(donor_rule, strategy):
    """A rank's message holds its own plan and whom it streams to; together they are the decision."""
    n = 24
    metrics = [float(x) for x in np.random.default_rng(3).normal(size=n)]
    metrics[5] = math.nan
    d = decide(metrics, ReplacementRule(ratio=0.25), donor_rule, strategy, iteration=9, rng=4,
               optimizer_policy="copy")
    messages = decision_messages(d, metrics)
    assert sorted(messages) == involved(d)
    for g, message in messages.items():
        message = json.loads(json.dumps(message))
        part = Decision.from_dict(message["decision"])
        assert part == d.part(g) and part.iteration == 9 and part.summary == d.summary
        assert message["recipients"] == list(d.recipients(g)) and "ranks" not in message
        assert message["metrics"][5] is None and message["metrics"][0] == metrics[0]
        if g in d.replaced:
            assert part.replaced == (g,) and part.donors[g] == d.donors[g] and part.weights[g] == d.weights[g]
            assert part.copy_optimizer_from[g] == d.copy_optimizer_from[g] and part.reasons[g] == d.reasons[g]
        else:
            assert part.replaced == () and part.donors == {}


def test_a_decision_message_grows_with_the_donors_not_with_the_whole_decision():
    """Averaging all others: the largest message is O(n) bytes (its donors, or its recipients)."""
    sizes = {}
    for n in (64, 256):
        metrics = [float(x) for x in np.random.default_rng(n).normal(size=n)]
        d = decide(metrics, ReplacementRule(ratio=0.25), DonorRule("all"), iteration=1)
        whole = len(json.dumps(d.to_dict()))
        largest = max(len(json.dumps(m)) for m in decision_messages(d, metrics).values())
        sizes[n] = whole, largest
    assert sizes[256][1] < sizes[256][0] / 20, f"a message is not a part: {sizes}"
    assert sizes[256][1] < 6 * sizes[64][1], f"not linear: {sizes}"
    assert sizes[256][0] > 12 * sizes[64][0], f"the whole decision is quadratic: {sizes}"


def test_recipients_of_merges_donor_sets():
    d = Decision((0, 3), {0: (1, 2), 3: (2, 4)}, {0: (0.5, 0.5), 3: (0.5, 0.5)}, {0: None, 3: 4}, "mean",
                 optimizer_policy="copy")
    assert recipients_of(d) == {1: [0], 2: [0, 3], 4: [3]}
    assert {g: list(d.recipients(g)) for g in (1, 2, 4)} == recipients_of(d)


def _book_with(n, iteration, metrics, book=None, now=0.0):
    book = CoordinatorBook(n) if book is None else book
    for r, m in enumerate(metrics):
        book.record(METRIC, r, iteration, m, 7, now=now)
    return book


def test_book_decides_the_newest_complete_iteration_once():
    book = _book_with(3, 0, [1.0, 2.0])
    assert book.next_decision() is None, "incomplete"
    _book_with(3, 0, [1.0, 2.0, 3.0], book)
    _book_with(3, 10, [4.0, 5.0, 6.0], book)
    assert book.next_decision() == (10, [4.0, 5.0, 6.0]) and book.skipped == 1
    assert book.next_decision() is None and not book.buckets
    book.record(METRIC, 0, 10, 9.0, 7)  # a late metric of a decided iteration is ignored
    assert not book.buckets


def test_book_holds_decisions_while_one_is_in_flight_and_fins_after_all_byes():
    book = _book_with(2, 0, [1.0, 2.0])
    book.next_decision()
    book.dispatched([0], iteration=0)
    _book_with(2, 5, [1.0, 2.0], book)
    assert book.next_decision() is None, "one decision in flight at a time"
    book.record(ACK, 0, 0, math.nan, 0)
    assert book.next_decision() == (5, [1.0, 2.0])
    book.record(BYE, 0, -1, math.nan, 0)
    assert not book.finished()
    book.record(BYE, 1, -1, math.nan, 0)
    assert book.finished()


def test_book_takes_acknowledgements_riding_in_metric_and_bye_rows():
    book = _book_with(3, 10, [1.0, 2.0, 3.0])
    book.next_decision()
    book.dispatched([0, 1], iteration=10)
    book.record(METRIC, 0, 20, 1.0, 7, acked=-1)
    book.record(METRIC, 1, 20, 2.0, 7, acked=0)  # an older decision's acknowledgement does not count
    book.record(METRIC, 2, 20, 3.0, 7)
    assert book.next_decision() is None and book.missing_acks() == [0, 1]
    book.record(ACK, 0, 10, math.nan, 0)
    assert book.missing_acks() == [1]
    book.record(BYE, 1, -1, math.nan, 0, acked=10)
    assert book.next_decision() == (20, [1.0, 2.0, 3.0])


def test_book_reports_stalled_ranks_but_not_ranks_that_said_bye():
    book = _book_with(3, 0, [1.0, 2.0], now=0.0)
    assert book.stalled(now=5.0, timeout=10.0) is None
    assert book.stalled(now=11.0, timeout=10.0) == (0, [2])
    book.record(BYE, 2, -1, math.nan, 0)
    assert book.stalled(now=11.0, timeout=10.0) is None



def test_book_does_not_count_a_rank_that_reported_a_later_iteration_as_stalled():
    """A rank that rejoined with its donor's iteration never reports the earlier ones: not a dead rank."""
    book = CoordinatorBook(3)
    for rank in (0, 1):
        book.record(METRIC, rank, 10, 1.0, 7, now=0.0)
    assert book.stalled(now=11.0, timeout=10.0) == (10, [2])
    book.record(METRIC, 2, 20, 1.0, 7, now=11.5)
    assert book.stalled(now=12.0, timeout=10.0) is None

def test_book_refuses_different_layouts_and_bounds_memory():
    book = CoordinatorBook(2, max_pending=4)
    book.record(METRIC, 0, 0, 1.0, 7)
    with pytest.raises(ConfigError, match="layouts differ"):
        book.record(METRIC, 1, 0, 1.0, 8)
    book = CoordinatorBook(2, max_pending=4)
    for it in range(10):
        book.record(METRIC, 0, it, 1.0, 7)
    assert sorted(book.buckets) == [6, 7, 8, 9]


# ---- records -----------------------------------------------------------------------------------
def test_event_log_writes_json_lines_per_rank(tmp_path):
    log = EventLog(tmp_path / "sub" / "ev-{rank}.jsonl", rank=3)
    log.write({"event": "replace", "metric": None})
    log.write({"event": "replace", "n": 2})
    log.close()
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "sub" / "ev-3.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["replace", "replace"] and "time" in lines[0]
    with pytest.raises(ConfigError, match="placeholder"):
        EventLog(tmp_path / "{host}.jsonl", rank=0)
    with pytest.raises(ConfigError, match="closed"):
        log.write({})


def test_policy_info_is_json_safe():
    info = PolicyInfo(3, "selective", acted=True, metrics={0: math.nan, 1: 2.0}, donors=(1,), weights=(1.0,))
    out = json.loads(json.dumps(info.to_dict(), allow_nan=False))
    assert out["metrics"] == {"0": None, "1": 2.0} and out["donors"] == [1]


# ---- a world of one is the identity ------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: AverageAll(every=2),
    lambda: SelectiveAveraging(every=2),
    lambda: AsyncSelectiveAveraging(every=2),
    lambda: OneSidedAveraging(every=2),
])
def test_every_policy_is_the_identity_in_a_world_of_one(make):
    policy = make()
    model = _filled(2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(4):
        model2, opt2, info = policy(it, model, opt, 1.0)
        assert model2 is model and opt2 is opt and not info.replaced and info.acted == (it % 2 == 0)
    assert all(torch.all(p == 2.0) for p in model.parameters())
    if hasattr(policy, "shutdown"):
        policy.shutdown()


def test_decision_points_need_a_metric_and_a_valid_iteration():
    with pytest.raises(ConfigError, match="local_metric"):
        SelectiveAveraging(every=1)(0, _filled(1.0), None, None)
    with pytest.raises(ConfigError, match="iteration"):
        AverageAll(every=1)(-1, _filled(1.0))
    assert isinstance(Decision.from_dict(decide([1.0, 2.0], ReplacementRule(ratio=0.5)).to_dict()), Decision)


def test_async_combiner_is_bit_identical_to_combine():
    import numpy as np

    from popmesh.population.decisions.combine import combine
    from popmesh.population.mechanisms.asynchronous.inbox import _Combiner

    rng = np.random.default_rng(0)
    combiner = _Combiner()

    def fed_one_by_one(per_donor, weights):
        combiner.begin(len(per_donor), weights)
        for arrays in per_donor:
            combiner.add(arrays)
        return combiner.result()

    for dtype in (np.float16, np.float32, np.float64):
        for donors in (1, 2, 3):
            per_donor = [{"float": rng.normal(size=257).astype(dtype), "b": rng.normal(size=3).astype(dtype)}
                         for _ in range(donors)]
            raw = rng.random(donors)
            weights = tuple(raw / raw.sum())
            fast, reference = fed_one_by_one(per_donor, weights), combine(per_donor, weights)
            for key in reference:
                assert fast[key].dtype == reference[key].dtype
                assert fast[key].tobytes() == reference[key].tobytes(), (dtype, donors, key)
    same_size = [{"h": rng.normal(size=5).astype(np.float16), "s": rng.normal(size=5).astype(np.float32)}
                 for _ in range(3)]  # one accumulator per name, even where sizes coincide
    combiner.begin(3, (0.5, 0.25, 0.25))
    for arrays in same_size:
        combiner.add(arrays)
    fast, reference = combiner.result(), combine(same_size, (0.5, 0.25, 0.25))
    assert all(fast[k].tobytes() == reference[k].tobytes() for k in reference)
    with pytest.raises(PopmeshError, match="expected 2"):
        combiner.begin(2, (0.5, 0.5))
        combiner.add(same_size[0])
        combiner.result()
    ints = [{"i": np.arange(4, dtype=np.int64)}, {"i": np.arange(4, dtype=np.int64) * 3}]
    assert fed_one_by_one(ints, (0.5, 0.5))["i"].tolist() == combine(ints, (0.5, 0.5))["i"].tolist()


def _inbox_job(decision, ranks, me):
    from popmesh.population.mechanisms.asynchronous.inbox import Job

    mine = ranks.index(me)
    donors = [ranks[d] for d in decision.donors.get(mine, ())]
    source = decision.copy_optimizer_from.get(mine)
    return Job(decision, list(ranks), {}, donors, None if source is None else ranks[source], math.inf)


def _stream(snapshot_iteration, decision_iteration, value):
    return {"meta": np.array([snapshot_iteration, decision_iteration], dtype=np.int64),
            "p/float32": torch.full((4,), value, dtype=torch.float32)}  # streams arrive as tensors


@pytest.mark.parametrize("decision_first", [True, False])
def test_inbox_combines_streams_whatever_their_order_against_the_decision(decision_first):
    from popmesh.population.decisions.combine import combine
    from popmesh.population.mechanisms.asynchronous.inbox import Inbox

    ranks = [10, 11, 12, 13]
    decision = decide([1.0, 4.0, 2.0, 3.0], ReplacementRule(ratio=0.25), iteration=7)  # replaces 10 by 11, 12, 13
    donors = _inbox_job(decision, ranks, 10).donors
    assert donors and 10 not in donors
    results = []
    for order in itertools.permutations(donors):
        inbox = Inbox(10)
        done = inbox.open(_inbox_job(decision, ranks, 10)) if decision_first else None
        for k, src in enumerate(order):
            out = inbox.stream(src, _stream(5 + k, 7, float(src)))
            assert (out is not None) == (decision_first and k == len(order) - 1)
            done = done or out
        if not decision_first:
            assert inbox.early() == {7: sorted(donors)}, "streams that came first wait for their decision"
            done = inbox.open(_inbox_job(decision, ranks, 10))
        assert done is not None and inbox.job is None and inbox.early() == {}
        assert done.decision_iteration == 7 and done.donors == tuple(donors)
        results.append(done.combined["float32"].tobytes())
    reference = combine([{"float32": np.full(4, float(d), np.float32)} for d in donors], decision.weights[0])
    assert set(results) == {reference["float32"].tobytes()}, "donor order, not arrival order, sets the sum"


def test_inbox_rejects_interleaved_and_stray_streams():
    from popmesh.population.mechanisms.asynchronous.inbox import Inbox

    ranks = [0, 1, 2, 3]
    decision = decide([1.0, 4.0, 2.0, 3.0], ReplacementRule(ratio=0.25), iteration=7)
    inbox = Inbox(0)
    assert inbox.open(_inbox_job(decision, ranks, 0)) is None
    with pytest.raises(PopmeshError, match="streams must not interleave"):
        inbox.stream(1, _stream(5, 9, 1.0))
    inbox.clear()
    inbox.stream(1, _stream(5, 3, 1.0))
    with pytest.raises(PopmeshError, match="streams must not interleave"):
        inbox.stream(1, _stream(6, 3, 1.0))  # the same donor twice for one decision
    with pytest.raises(PopmeshError, match="never replaced it"):
        inbox.open(_inbox_job(decision, ranks, 0))
    reset = decide([1.0, 4.0, 2.0, 3.0], ReplacementRule(ratio=0.25), strategy="reset_weights", iteration=8)
    done = Inbox(0).open(_inbox_job(reset, ranks, 0))
    assert done is not None and done.combined is None and done.donors == (), "reset_weights waits for nobody"


def test_explore_reads_and_writes_only_the_chosen_param_groups():
    """A model whose groups train at their own rates (torchgfn's logZ at 0.1 beside the policy's) explores
    one group; the others keep their values, at the explore step and when assigned a donor's values."""
    from popmesh.population.decisions.hparams import current_values
    from popmesh.population.state.replace import set_hparams

    def two_groups():
        return torch.optim.Adam([{"params": nn.Linear(2, 2).parameters(), "lr": 1e-3},
                                 {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1}])

    first = Explore(resample_prob=0.0, param_groups=(0,))
    opt = two_groups()
    first.apply(opt, seed=1, iteration=3, rank=0)
    assert opt.param_groups[0]["lr"] in (pytest.approx(8e-4), pytest.approx(1.2e-3))
    assert opt.param_groups[1]["lr"] == 0.1
    assert current_values(Explore(param_groups=(1,)), two_groups(), None) == {"lr": 0.1}
    set_hparams(opt, {"lr": 5e-3}, first)
    assert [g["lr"] for g in opt.param_groups] == [5e-3, 0.1]
    set_hparams(opt, {"lr": 2e-3})  # no Explore: every group that has the key
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 2e-3]
    with pytest.raises(ConfigError, match=r"param_groups \[2\] are not among the optimizer's 2 param group\(s\)"):
        Explore(param_groups=(2,)).apply(two_groups(), 0, 0, 0)
    for bad in ((), (0, 0), (-1,), (True,), ("0",)):
        with pytest.raises(ConfigError, match="Explore param_groups must be distinct indexes"):
            Explore(param_groups=bad)
