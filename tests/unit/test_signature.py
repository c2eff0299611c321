"""The always-on check's pure parts: signatures, the per-group history and its prediction, and the
guard's test (popmesh.comm.signature), without processes."""

import numpy as np
import pytest

from popmesh.comm.signature import (
    MASK,
    Form,
    History,
    Sentinel,
    advance,
    agrees,
    count_as_predicted,
    digest,
    expected_sum,
    forget,
    guard_word,
    predict,
    record,
    rest_predicted,
    sentinel_for,
)
from popmesh.core.ops import ReduceOp, lower


def _form(tag):
    return Form(lambda arrays, timeout: tag, ((False, np.dtype("float32"), (4,), None),))


def _guard(signatures):
    """Each rank's reading of one guard: the engines' int64 SUM (wrapping) of every rank's word."""
    with np.errstate(over="ignore"):
        total = int(np.sum(np.array([guard_word(s) for s in signatures], dtype=np.int64), dtype=np.int64))
    return [agrees(total, s, len(signatures)) for s in signatures]


def test_digest_is_stable_nonzero_and_fits_the_guard():
    a, b = digest("all_reduce(sum) * float32[4]"), digest("all_reduce(sum) * int32[4]")
    assert a == digest("all_reduce(sum) * float32[4]") and a != b
    assert 0 < a <= MASK and 0 < b <= MASK and -a >= -(1 << 63)
    assert digest("") != 0


def test_prediction_follows_the_pattern_of_verified_calls():
    h = History()
    assert predict(h) == 0  # a fresh group predicts nothing: its first call waits for the guard
    pattern = [11, 22, 33]
    for sig in pattern:
        record(h, sig, _form(sig))
    assert predict(h) == 0  # 33 was never followed by anything yet
    hits = 0
    for _ in range(5):
        for sig in pattern:
            hits += predict(h) == sig
            record(h, sig, _form(sig))
    # a transition is predicted once seen twice in a row: 11->22 and 22->33 from round 1, 33->11 from round 2
    assert hits == 15 - 4
    assert h.forms[22].run([], 1.0) == 22  # each verified signature keeps how to replay its payload


def test_a_failed_prediction_is_dropped_and_an_alternation_is_never_guessed():
    h = History()
    for sig in (1, 2, 1, 2, 1, 2):
        record(h, sig, _form(sig))
    assert predict(h) == 1
    record(h, 3, _form(3))  # 2 was followed by 3, not the predicted 1: nothing is predicted after 2 now
    assert h.after.get(2) is None and h.pending[2] == 3
    guessed_after_2 = 0
    for sig in (2, 1, 2, 3) * 5:  # 2 is followed by 1 and 3 in turn
        guessed_after_2 += h.last == 2 and predict(h) != 0
        record(h, sig, _form(sig))
    assert guessed_after_2 == 0


def test_forms_are_built_once_and_forget_starts_again():
    h = History()
    built = []
    record(h, 5, lambda: built.append(5) or _form(5))
    record(h, 5, lambda: built.append(6) or _form(6))
    record(h, 5, lambda: built.append(7) or _form(7))
    assert built == [5] and h.last == 5 and predict(h) == 5
    forget(h)
    assert h.last == 0 and predict(h) == 0 and not h.forms


def test_history_is_bounded_the_same_way_on_every_rank():
    one, two = History(), History()
    for sig in range(1, 10_000):
        record(one, sig, _form(sig))
        record(two, sig, _form(sig))
    assert len(one.after) <= 4096 and one.after == two.after and one.last == two.last


def test_a_mismatched_call_counts_as_the_prediction_on_every_rank():
    """An asynchronous call that is the prediction enters the history when it starts, and the rank
    starts its next call predicted from there before it finds the mismatch at wait(); the rank whose
    call differed finds it at once: counting the call as the prediction, it predicts its next call
    as the other did, so the two make the same engine calls for it."""
    went_ahead, differed = History(), History()
    for h in (went_ahead, differed):
        for sig in (1, 2) * 3:
            record(h, sig, _form(sig))
    assert predict(went_ahead) == predict(differed) == 1
    advance(went_ahead, 1)  # its call k: the prediction, issued beside its guard
    next_call = predict(went_ahead)  # its call k + 1, started before call k is waited for
    count_as_predicted(differed, predict(differed))  # call k mismatched here
    assert predict(differed) == next_call == 2
    assert (differed.last, differed.after, differed.pending) == (went_ahead.last, went_ahead.after,
                                                                 went_ahead.pending)


def test_a_mismatch_without_a_prediction_leaves_the_history():
    h = History()
    record(h, 5, _form(5))
    before = (h.last, dict(h.after), dict(h.pending))
    count_as_predicted(h, predict(h))  # nothing was predicted: every rank found it at the call itself
    assert (h.last, h.after, h.pending) == before


def _total(signatures):
    return sum(signatures) % (1 << 64)


@pytest.mark.parametrize("p, calls", [(7, [7, 7, 9]), (MASK, [MASK, MASK, MASK, 3]), (11, [11, 13])])
def test_ranks_that_made_the_prediction_need_not_be_heard(p, calls):
    """A rank whose call differed hears nobody else when every other rank made the prediction."""
    odd = calls[-1]
    assert rest_predicted(_total(calls), [odd], len(calls) - 1, p)
    assert not rest_predicted(_total(calls), [p], len(calls) - 1, p)  # a rank that made it must hear the odd one
    assert rest_predicted(_total(calls), [p, odd], len(calls) - 2, p)


def test_every_rank_that_differed_is_heard():
    p = digest("all_reduce_async(sum) * float32[8]")
    shape, dtype = digest("all_reduce_async(sum) * float32[9]"), digest("all_reduce_async(sum) * float64[8]")
    total = _total([p, dtype, shape])
    assert not rest_predicted(total, [shape], 2, p)  # rank 1 differed too: keep listening
    assert not rest_predicted(total, [p], 2, p) and not rest_predicted(total, [p, shape], 1, p)
    assert rest_predicted(total, [shape, dtype], 1, p) and rest_predicted(total, [p, shape, dtype], 0, p)


def test_without_a_prediction_every_rank_is_heard():
    calls = [digest(f"all_reduce(sum) * float32[{n}]") for n in (4, 5, 6)]
    total = _total(calls)
    assert not rest_predicted(total, calls[:1], 2, 0) and not rest_predicted(total, calls[:2], 1, 0)
    assert rest_predicted(total, calls, 0, 0)


def test_guard_all_equal():
    assert _guard([7, 7, 7]) == [True] * 3
    assert expected_sum(7, 3) == 21 and agrees(expected_sum(7, 3), 7, 3)


def test_guard_sums_wrap_like_int64():
    assert _guard([MASK] * 5) == [True] * 5  # the sum overflows int64 and still compares exactly
    assert -(1 << 63) <= expected_sum(MASK, 5) < 1 << 63


@pytest.mark.parametrize("other", [8, 1, MASK, 7 + (1 << 61), 7 + (1 << 62)])
def test_guard_finds_any_difference_in_a_pair_on_both_ranks(other):
    assert _guard([7, other]) == [False, False]  # exact in a group of two


def test_guard_with_three_ranks_one_odd():
    assert _guard([7, 7, 9]) == [False] * 3
    calls = [digest(f"all_reduce(sum) * float32[{n}]") for n in (4, 5, 6)]
    assert _guard(calls) == [False] * 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "max", "min"])
def test_every_float_reduction_carries_its_check(dtype, op):
    sentinel = sentinel_for(dtype, lower(ReduceOp(op), dtype), 4)
    assert sentinel is not None and sentinel.nonfinite and not sentinel.as_bytes
    assert sentinel.flags(sentinel.value) and sentinel.flags(float("nan")) and not sentinel.flags(3.5)
    assert sentinel.flags(float("inf")) and sentinel.flags(float("-inf"))


def _reduce(op, values, dtype):
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    with np.errstate(all="ignore"):
        return ufunc.reduce(np.array(values, dtype=dtype))


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "int8", "int64", "uint8", "bool"])
def test_a_sentinel_always_shows_in_the_reduced_element(op, dtype):
    """Whatever the other ranks contribute, and in whatever order the engine reduces, one rank's
    sentinel leaves element 0 of the result flagged (numpy's reductions stand in for the engines')."""
    lowering = lower(ReduceOp(op), dtype)
    sentinel = sentinel_for(dtype, lowering, 1)
    if sentinel is None:
        assert (dtype in ("int8", "int64") and op in ("sum", "prod")) or (dtype in ("uint8", "bool") and op != "max"
                                                                           and not (dtype == "bool" and op == "sum"))
        return
    engine_dtype = "uint8" if lowering.as_bytes else dtype
    engine_op = lowering.engine_op.value
    info = np.finfo(engine_dtype) if engine_dtype.startswith("float") else np.iinfo(engine_dtype)
    others = [0, 1, info.max, info.min] + ([float("nan"), float("inf"), -float("inf")] if dtype == "float32" else [])
    for a in others:
        for b in others:
            for values in ([sentinel.value, a, b], [a, sentinel.value, b], [a, b, sentinel.value]):
                out = _reduce(engine_op, values, engine_dtype)
                assert sentinel.flags(out.item()), (values, out)


def test_no_sentinel_where_every_value_is_ordinary_data():
    assert sentinel_for("int32", lower(ReduceOp.SUM, "int32"), 4) is None
    assert sentinel_for("int32", lower(ReduceOp.AVG, "int32"), 4) is None
    assert sentinel_for("bool", lower(ReduceOp.MIN, "bool"), 4) is None
    assert sentinel_for("complex64", lower(ReduceOp.SUM, "complex64"), 4) is None
    assert sentinel_for("float32", lower(ReduceOp.SUM, "float32"), 0) is None  # nothing to carry it
    assert sentinel_for("bool", lower(ReduceOp.SUM, "bool"), 4) == Sentinel(255, False, True)
    assert sentinel_for("int8", lower(ReduceOp.MIN, "int8"), 4) == Sentinel(-128, False, False)
