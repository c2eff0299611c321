"""The always-on check's pure parts: signatures, the per-group history and its prediction, and the
guard's test (popmesh.comm.signature), without processes."""

import numpy as np
import pytest

from popmesh.comm.signature import (
    MASK,
    Form,
    History,
    agrees,
    digest,
    expected_sum,
    forget,
    guard_word,
    predict,
    record,
)


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
