"""The always-on check's pure parts: signatures, the per-group history and its prediction, and the
guard's verdict (popmesh.comm.signature), without processes."""

import numpy as np
import pytest

from popmesh.comm.signature import (
    MASK,
    Form,
    History,
    digest,
    expected_guard,
    forget,
    guard_vector,
    predict,
    read_guard,
    record,
)


def _form(tag):
    return Form(lambda arrays, timeout: tag, ((False, np.dtype("float32"), (4,), None),))


def _reduce_sum(vectors):
    """What the guard's SUM all-reduce returns on every rank: int64 words, wrapping as the engines do."""
    total = np.sum(np.array(vectors, dtype=np.int64), axis=0, dtype=np.int64)
    return total.tolist()


def _verdicts(vectors):
    """Each rank's verdict of one guard."""
    out = _reduce_sum(vectors)
    return [read_guard(out, mine, len(vectors)) for mine in vectors]


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
    assert hits == 15 - 1  # every call of the repeated pattern is predicted but the first one after 33
    assert h.forms[22].run([], 1.0) == 22  # each verified signature keeps how to replay its payload


def test_forms_are_built_once_and_forget_starts_again():
    h = History()
    built = []
    record(h, 5, lambda: built.append(5) or _form(5))
    record(h, 5, lambda: built.append(6) or _form(6))
    assert built == [5] and h.last == 5 and predict(h) == 5
    forget(h)
    assert h.last == 0 and predict(h) == 0 and not h.forms


def test_history_is_bounded_the_same_way_on_every_rank():
    one, two = History(), History()
    for sig in range(1, 10_000):
        record(one, sig, _form(sig))
        record(two, sig, _form(sig))
    assert len(one.after) <= 4096 and one.after == two.after and one.last == two.last


def test_guard_all_equal_hits():
    mine = guard_vector(7, True, 7, True)
    out = _reduce_sum([mine, mine, mine])
    assert out == expected_guard(mine, 3)  # the fast path: the sum is size times this rank's words
    v = read_guard(out, mine, 3)
    assert v.same and v.any_hit and v.all_hit and v.same_prediction and v.in_step and v.all_blocking


def test_guard_words_wrap_like_int64():
    big = MASK  # the largest signature: its sums overflow int64 and must still compare exactly
    mine = guard_vector(big, True, big, True)
    with np.errstate(over="ignore"):
        out = _reduce_sum([mine] * 5)
    assert out == expected_guard(mine, 5) and read_guard(out, mine, 5).same


@pytest.mark.parametrize("other", [8, 1, MASK, 7 + (1 << 61)])
def test_guard_finds_any_difference_on_every_rank(other):
    for v in _verdicts([guard_vector(7, True, 7, True), guard_vector(other, False, 7, True)]):
        assert not v.same and v.any_hit and not v.all_hit and v.same_prediction
        assert v.completable and v.describable  # all blocking: every rank can still list its call


def test_guard_with_three_ranks_one_odd():
    vectors = [guard_vector(7, True, 7, True), guard_vector(7, True, 7, True), guard_vector(9, False, 7, True)]
    assert all(not v.same and v.completable for v in _verdicts(vectors))
    calls = [digest(f"all_reduce(sum) * float32[{n}]") for n in (4, 5, 6)]
    assert all(not v.same for v in _verdicts([guard_vector(s, False, 0, True) for s in calls]))


def test_guard_asynchronous_hits_cannot_list_every_rank():
    vs = _verdicts([guard_vector(7, True, 7, False), guard_vector(9, False, 7, True)])
    assert all(not v.same and not v.describable and v.completable for v in vs)
    vs = _verdicts([guard_vector(7, False, 0, False), guard_vector(9, False, 0, True)])
    assert all(not v.same and v.describable for v in vs)  # nobody hit: every rank waits at this call's guard


def test_guard_diverged_histories():
    vs = _verdicts([guard_vector(7, True, 7, False), guard_vector(9, False, 3, True)])
    assert all(not v.same and not v.same_prediction and not v.completable for v in vs)
    vs = _verdicts([guard_vector(7, True, 7, False), guard_vector(7, False, 0, True)])
    assert all(v.same and not v.in_step for v in vs)  # the payloads match; the histories start again
