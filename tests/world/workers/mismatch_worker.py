"""Mismatched collectives without check mode: every rank raises CollectiveMismatch, fast, and the
group keeps working for correct calls afterwards. The last rank is the odd one out; the others
contribute r + 1, so the correct calls around each mismatch have closed forms."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import CollectiveMismatch
from popmesh.comm.signature import predict
from worldlib import check, need_ranks

try:
    import torch
except ImportError:  # pragma: no cover - torch is part of the test environment
    torch = None

FAST_S = 5.0  # far below the world's 30 s timeout: a mismatch is found, not waited out


def total(n):
    return n * (n + 1) // 2


def odd(w):
    return w.rank == w.size - 1


def expect_mismatch(call, *texts, ranks):
    """``call()`` must raise CollectiveMismatch within FAST_S, naming ``texts`` and listing every rank
    of ``ranks``."""
    start = time.perf_counter()
    try:
        call()
    except CollectiveMismatch as e:
        elapsed = time.perf_counter() - start
        assert elapsed < FAST_S, f"the mismatch took {elapsed:.1f} s to surface"
        for text in texts:
            assert text in str(e), (text, str(e))
        assert e.per_rank is not None and set(e.per_rank) == set(ranks), (e.per_rank, ranks)
        return e
    raise AssertionError(f"expected CollectiveMismatch from {call}")


def still_works(w, group=None):
    """A correct call after the mismatch: the group is clean (nothing left in flight)."""
    members = list(group.ranks) if group is not None else list(range(w.size))
    out = popmesh.all_reduce(np.full(3, w.rank + 1.0), group=group)
    assert np.all(out == sum(m + 1 for m in members)), out


@check
def same_bytes_different_dtypes(w):
    need_ranks(w, 2)
    x = np.full(4, w.rank + 1, dtype=np.int32 if odd(w) else np.float32)
    expect_mismatch(lambda: popmesh.all_reduce(x), "float32[4]", "int32[4]", ranks=range(w.size))
    t = torch.full((4,), w.rank + 1, dtype=torch.int32 if odd(w) else torch.float32)
    expect_mismatch(lambda: popmesh.all_reduce_(t), "float32[4]", "int32[4]", ranks=range(w.size))
    assert torch.all(t == w.rank + 1), "a mismatched in-place call must leave its input alone"
    still_works(w)


@check
def different_shapes(w):
    """gloo aborted the process here (its size enforce); MPI returned partly reduced arrays."""
    need_ranks(w, 2)
    x = np.ones(5 if odd(w) else 4, dtype=np.float32)
    expect_mismatch(lambda: popmesh.all_reduce(x), "float32[4]", "float32[5]", ranks=range(w.size))
    expect_mismatch(lambda: popmesh.all_reduce(np.ones((2, 2) if odd(w) else 4)), "float64[4]", "float64[2,2]",
                    ranks=range(w.size))
    still_works(w)


@check
def tenfold_size(w):
    """MPI returned at once on one rank and timed out on the other, blaming a rank that did arrive."""
    need_ranks(w, 2)
    x = np.ones(10_000 if odd(w) else 1000, dtype=np.float32)
    expect_mismatch(lambda: popmesh.all_reduce(x), "float32[1000]", "float32[10000]", ranks=range(w.size))
    still_works(w)


@check
def broadcast_into_other_dtype_or_shape(w):
    need_ranks(w, 2)
    src = np.arange(4, dtype=np.float32) + 7
    into = np.zeros(4, dtype=np.int32) if odd(w) else src.copy()
    expect_mismatch(lambda: popmesh.broadcast_(into, src=0), "float32[4]", "int32[4]", ranks=range(w.size))
    assert not odd(w) or np.all(into == 0), "the receiving buffer must be left alone"
    shaped = src.reshape(2, 2).copy() if odd(w) else src.copy()
    expect_mismatch(lambda: popmesh.broadcast(shaped, src=0), "float32[4]", "float32[2,2]", ranks=range(w.size))
    assert np.all(popmesh.broadcast(np.full(4, float(w.rank)), src=w.size - 1) == w.size - 1)


@check
def reduce_scatter_and_nested(w):
    need_ranks(w, 2)
    n = w.size
    x = np.ones(4 * n if odd(w) else 2 * n, dtype=np.float32)
    expect_mismatch(lambda: popmesh.reduce_scatter(x), f"float32[{2 * n}]", f"float32[{4 * n}]", ranks=range(n))
    tree = {"a": np.ones(3, dtype=np.float32), "b": np.ones(2, dtype=np.int32 if odd(w) else np.int64)}
    expect_mismatch(lambda: popmesh.all_reduce(tree), "int32[2]", "int64[2]", ranks=range(n))
    # the same dtypes and shapes, but a torch leaf beside a numpy one is fused apart: other engine calls
    mixed = {"a": np.ones(3, dtype=np.float32), "b": torch.ones(2) if odd(w) else np.ones(2, dtype=np.float32)}
    expect_mismatch(lambda: popmesh.all_reduce(mixed), "fused 0|1", ranks=range(n))
    out = popmesh.reduce_scatter(np.full(2 * n, w.rank + 1.0))
    assert out.shape == (2,) and np.all(out == total(n)), out


@check
def different_collectives(w):
    need_ranks(w, 2)
    x = np.ones(4, dtype=np.float32)
    call = (lambda: popmesh.broadcast(x, src=0)) if odd(w) else (lambda: popmesh.all_reduce(x))
    expect_mismatch(call, "all_reduce(sum)", "broadcast(src=0)", ranks=range(w.size))
    call = (lambda: popmesh.all_reduce(x, "max")) if odd(w) else (lambda: popmesh.all_reduce(x))
    expect_mismatch(call, "all_reduce(sum)", "all_reduce(max)", ranks=range(w.size))
    still_works(w)


@check
def a_tensor_on_another_device(w):
    """The same dtype and shape on another kind of device (meta standing in for CUDA on a CPU machine):
    a mismatch naming the device, found by the always-on guard, also after a run of predicted host calls
    (on MPI the off-host rank refuses before its guard, so this is the torch engine's case)."""
    need_ranks(w, 2)
    if w.engine_name != "torch":
        return
    n, r = w.size, w.rank
    for warm_up in (0, 20):
        for _ in range(warm_up):
            assert torch.all(popmesh.all_reduce(torch.full((4,), r + 1.0)) == total(n))
        x = torch.empty(4, device="meta") if odd(w) else torch.full((4,), r + 1.0)
        expect_mismatch(lambda x=x: popmesh.all_reduce(x), "float32[4]@meta", ranks=range(n))
        tree = {"a": x, "b": torch.ones(2)}
        expect_mismatch(lambda tree=tree: popmesh.all_reduce(tree), "float32[4]@meta", ranks=range(n))
        still_works(w)


@check
def mismatch_after_many_hits(w):
    """A long run of identical calls (each predicted, its guard beside the payload), then one rank
    changes dtype, then shape: found all the same, and the run goes on correctly."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    for round_ in range(3):
        for _ in range(50):
            out = popmesh.all_reduce(np.full(4, r + 1.0, dtype=np.float32))
            assert np.all(out == total(n)) and out.dtype == np.float32, out
            nested = popmesh.all_reduce({"g": np.full(2, r + 1.0), "k": np.full(1, r + 1, dtype=np.int64)}, "avg")
            assert np.all(nested["g"] == (n + 1) / 2) and nested["k"][0] == total(n) // n, nested
        assert predict(w.history) != 0, "the flat call after the nested one must be predicted (a hit)"
        wrong = [np.float64, np.float32, np.float32][round_]
        shape = [4, 5, 40][round_]
        x = np.full(shape if odd(w) else 4, r + 1.0, dtype=wrong if odd(w) else np.float32)
        predicted = predict(w.history)
        expect_mismatch(lambda x=x: popmesh.all_reduce(x), "float32[4]", ranks=range(n))
        assert w.history.last == predicted, "a mismatched call counts as the prediction on every rank"


@check
def async_mismatch(w):
    """Asynchronous all-reduces: a mismatch at the first call (found when it starts) and after a run of
    predicted calls (the ranks that overlapped find it at wait(); the odd rank when it starts)."""
    need_ranks(w, 2)
    n, r = w.size, w.rank

    def start_and_wait(x):
        return popmesh.all_reduce_async(x).wait()

    group = w.new_group(list(range(n)))  # a fresh history: the first call there has no prediction
    first = np.ones(3 if odd(w) else 2, dtype=np.float32)
    expect_mismatch(lambda: popmesh.all_reduce_async(first, group=group).wait(), "float32[2]", "float32[3]",
                    ranks=range(n))
    for _ in range(30):
        handles = [popmesh.all_reduce_async_(torch.full((8,), r + 1.0)) for _ in range(3)]
        assert all(torch.all(h.wait() == total(n)) for h in handles)
    x = torch.full((8,), r + 1.0, dtype=torch.float64 if odd(w) else torch.float32)
    expect_mismatch(lambda: start_and_wait(x), "float32[8]", "float64[8]", ranks=range(n))
    still_works(w)
    assert torch.all(popmesh.all_reduce_async(torch.full((8,), r + 1.0)).wait() == total(n))


# ---- an asynchronous mismatch while later calls of the group are in flight ---------------------
def warm_async_pair(w):
    """Start and wait a then b until both are predicted: a rank whose call is the prediction then
    returns at once and finds a mismatch only at wait(), after it started the calls that follow."""
    n, r = w.size, w.rank
    for _ in range(5):
        a, b = popmesh.all_reduce_async(torch.full((8,), r + 1.0)), popmesh.all_reduce_async(torch.full((16,), r + 1.0))
        assert torch.all(a.wait() == total(n)) and torch.all(b.wait() == total(n))
    assert predict(w.history) != 0


def start_pair(w, first, second):
    """Start ``first`` then ``second`` (tensors); a start that raises CollectiveMismatch is kept as its
    error. Returns the two handles or errors."""
    out = []
    for x in (first, second):
        try:
            out.append(popmesh.all_reduce_async(x))
        except CollectiveMismatch as e:
            out.append(e)
    return out


def mismatched_at(outcome, texts, ranks):
    """``outcome`` (a handle or the error its start raised) raises CollectiveMismatch naming ``texts``."""
    if isinstance(outcome, CollectiveMismatch):
        for text in texts:
            assert text in str(outcome), (text, str(outcome))
        assert set(outcome.per_rank) == set(ranks), outcome.per_rank
        return outcome
    return expect_mismatch(outcome.wait, *texts, ranks=ranks)


@check
def async_mismatch_with_later_calls_in_flight(w):
    """The odd rank's first call differs (shape, dtype or op) while the other ranks, whose call is the
    prediction, have already started the second: every rank raises for the first call (the odd rank at
    once, the others at wait(), in either order), the second returns the exact sum everywhere, and the
    group goes on working. Before: the odd rank waited up to the timeout for the others' descriptions
    when they waited in reverse order, and the others' group was left unusable, their next collective
    raising there while the odd rank's waited out the timeout."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    mine = {"shape": (torch.full((9,), r + 1.0), "sum", "float32[9]"),
            "dtype": (torch.full((8,), r + 1.0, dtype=torch.float64), "sum", "float64[8]"),
            "op": (torch.full((8,), r + 1.0), "max", "all_reduce_async(max)")}
    for reverse in (False, True):
        for kind, (other, op, text) in mine.items():
            warm_async_pair(w)
            if odd(w):
                first = expect_mismatch(lambda other=other, op=op: popmesh.all_reduce_async(other, op),
                                        "all_reduce_async(sum) * float32[8]", text, ranks=range(n))
                handles = [first, popmesh.all_reduce_async(torch.full((16,), r + 1.0))]
            else:
                handles = start_pair(w, torch.full((8,), r + 1.0), torch.full((16,), r + 1.0))
            for i in (1, 0) if reverse else (0, 1):
                if i == 1:
                    assert torch.all(handles[1].wait() == total(n)), (kind, reverse)
                else:
                    e = mismatched_at(handles[0], ["all_reduce_async(sum) * float32[8]", text], range(n))
                    assert odd(w) or "1 call(s) this rank started on the group after it" in str(e), str(e)
            still_works(w)
    warm_async_pair(w)  # the mismatch is in the second call: found when the odd rank starts it
    handles = start_pair(w, torch.full((8,), r + 1.0), torch.full((17 if odd(w) else 16,), r + 1.0))
    assert torch.all(handles[0].wait() == total(n))
    mismatched_at(handles[1], ["float32[16]", "float32[17]"], range(n))
    warm_async_pair(w)


@check
def async_mismatch_then_a_blocking_call(w):
    """After the odd rank's first asynchronous call raised, every rank makes a blocking call while
    the others' two asynchronous calls are still unwaited: it returns the exact sum at once. Before:
    the odd rank waited in its error for the others' descriptions while they waited in the blocking
    call for it, both until the timeout."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    warm_async_pair(w)
    handles = start_pair(w, torch.full((9 if odd(w) else 8,), r + 1.0), torch.full((16,), r + 1.0))
    assert isinstance(handles[0], CollectiveMismatch) == odd(w), handles
    start = time.perf_counter()
    for size in (4, 1 << 18):
        out = popmesh.all_reduce(np.full(size, r + 1.0, dtype=np.float32))
        assert np.all(out == total(n)), out[:4]
    assert time.perf_counter() - start < FAST_S
    mismatched_at(handles[0], ["float32[8]", "float32[9]"], range(n))
    assert torch.all(handles[1].wait() == total(n))
    still_works(w)
    warm_async_pair(w)


@check
def async_mismatch_then_a_skipped_call(w):
    """After its error the odd rank skips the second call the others started and makes the next one:
    that call and the others' second raise on every rank (saying an earlier call mismatched too,
    whichever the others wait for first), none hangs, and once the ranks are in step again the group
    works. Before: the odd rank's call waited out the timeout."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    x = np.full(3, r + 1.0)
    second = ["all_reduce_async(sum) * float32[16]", "all_reduce(sum) * float64[3]"]
    for reverse in (False, True):
        warm_async_pair(w)
        if odd(w):
            expect_mismatch(lambda: popmesh.all_reduce_async(torch.full((9,), r + 1.0)), "float32[9]",
                            ranks=range(n))
            e = expect_mismatch(lambda: popmesh.all_reduce(x), *second, ranks=range(n))
        else:
            handles = start_pair(w, torch.full((8,), r + 1.0), torch.full((16,), r + 1.0))
            if reverse:  # the odd rank's description of the first call arrives before it is asked for
                e = mismatched_at(handles[1], second, range(n))
                mismatched_at(handles[0], ["float32[8]", "float32[9]"], range(n))
            else:
                mismatched_at(handles[0], ["float32[8]", "float32[9]"], range(n))
                e = mismatched_at(handles[1], second, range(n))
        assert (reverse and not odd(w)) or "previous mismatch was 1 call(s) earlier" in str(e), str(e)
        assert np.all(popmesh.all_reduce(x) == total(n))  # every rank's next call: in step again
    warm_async_pair(w)


@check
def async_mismatch_two_ranks_differ(w):
    """Two ranks leave the prediction with different calls while the others went ahead: every rank's
    error lists all three calls (the ranks that left tell theirs; the others' is the prediction)."""
    need_ranks(w, 3)
    n, r = w.size, w.rank
    warm_async_pair(w)
    mine = {n - 1: torch.full((9,), r + 1.0), n - 2: torch.full((8,), r + 1.0, dtype=torch.float64)}
    handles = start_pair(w, mine.get(r, torch.full((8,), r + 1.0)), torch.full((16,), r + 1.0))
    for i in (1, 0) if r % 2 else (0, 1):
        if i == 1:
            assert torch.all(handles[1].wait() == total(n))
        else:
            e = mismatched_at(handles[0], ["float32[8]", "float32[9]", "float64[8]"], range(n))
            assert e.per_rank[0] == "all_reduce_async(sum) * float32[8]", e.per_rank
    still_works(w)
    warm_async_pair(w)


@check
def subgroup_mismatch(w):
    """Histories are per group: a run on the world does not predict a subgroup's calls, and a
    mismatch on a subgroup leaves the world's run alone."""
    need_ranks(w, 2)
    members = [0, w.size - 1]
    g = w.new_group(members)
    for _ in range(20):
        popmesh.all_reduce(np.ones(4, dtype=np.float32))
        if g.is_member:
            out = popmesh.all_reduce(np.full(4, w.rank + 1.0, dtype=np.float32), group=g)
            assert np.all(out == sum(m + 1 for m in members)), out
    if g.is_member:
        x = np.ones(6 if odd(w) else 4, dtype=np.float32)
        expect_mismatch(lambda: popmesh.all_reduce(x, group=g), "float32[4]", "float32[6]", ranks=members)
        still_works(w, g)
    still_works(w)


# ---- calls that carry their check (popmesh.comm.signature.Sentinel) ------------------------------
SIZES = (1, 256, 1 << 18)  # 4 B, 1 KB, 1 MB of float32


def warm(call, times=3):
    """Repeat ``call`` until the group predicts it (a transition is learnt once seen twice in a row)."""
    for _ in range(times):
        call()


def carried(w):
    return w.history.carried is not None


@check
def carried_results_are_exact(w):
    """Once a call is predicted, its payload runs alone and carries the check: the same exact results
    as the first, guarded calls, for every op, numpy and torch, returning and in place, at each size."""
    n, r = w.size, w.rank
    fact = float(np.prod(np.arange(1, n + 1)))
    for size in SIZES:
        for op, want in (("sum", total(n)), ("avg", (n + 1) / 2), ("max", n), ("min", 1), ("prod", fact)):
            for step in range(4):
                out = popmesh.all_reduce(np.full(size, r + 1.0, dtype=np.float32), op)
                assert out.dtype == np.float32 and np.all(out == want), (size, op, step, out[:4])
                t = torch.full((size,), r + 1.0, dtype=torch.float64)
                assert popmesh.all_reduce_(t, op) is t and torch.all(t == want), (size, op, step, t[:4])
            assert carried(w), (size, op)
        for op, want in (("max", n), ("min", 1)):
            for step in range(4):
                x = np.full(size, r + 1, dtype=np.int32)
                assert popmesh.all_reduce_(x, op) is x and np.all(x == want), (size, op, step)
            assert carried(w), (size, op)
        for step in range(4):  # numpy and torch arrays of one dtype and shape make the same call
            x = np.full(size, r + 1.0, dtype=np.float32) if step % 2 == r % 2 else torch.full((size,), r + 1.0)
            out = popmesh.all_reduce(x, "max")
            assert type(out) is type(x) and out.dtype == x.dtype and float(out.max()) == n == float(out.min())
        for step in range(4):
            anyone = popmesh.all_reduce(torch.full((size,), odd(w)), "max")  # booleans reduce their bytes
            assert anyone.dtype == torch.bool and torch.all(anyone), (size, step)
            assert np.all(popmesh.all_reduce(np.full(size, r + 1, dtype=np.int64)) == total(n))  # guarded: no sentinel


@check
def carried_mismatch_at_each_size(w):
    """After a run of predicted calls, the odd rank changes shape, dtype, op or collective: every rank
    raises at once; a rank whose in-place payload ran says its input was overwritten, the odd rank's
    input and every returning call's input are left alone."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    for size in SIZES:
        for other in (np.ones(size + 1, dtype=np.float32), np.ones(size, dtype=np.float64)):
            warm(lambda size=size: popmesh.all_reduce_(np.full(size, r + 1.0, dtype=np.float32)))
            assert carried(w)
            mine = other.copy() if odd(w) else np.full(size, r + 1.0, dtype=np.float32)
            before = mine.copy()
            e = expect_mismatch(lambda mine=mine: popmesh.all_reduce_(mine), f"float32[{size}]", ranks=range(n))
            assert ("input was overwritten" in str(e)) == (not odd(w)), str(e)
            assert odd(w) or not np.array_equal(mine, before), "the in-place payload ran"
            assert not odd(w) or np.array_equal(mine, before), "a rank that left the prediction writes nothing"
            warm(lambda size=size: popmesh.all_reduce(np.full(size, r + 1.0, dtype=np.float32), "max"))
            mine = other.copy() if odd(w) else np.full(size, r + 1.0, dtype=np.float32)
            before = mine.copy()
            e = expect_mismatch(lambda mine=mine: popmesh.all_reduce(mine, "max"), "all_reduce(max)", ranks=range(n))
            assert np.array_equal(mine, before) and "no input was written" in str(e), str(e)
        warm(lambda size=size: popmesh.all_reduce(np.ones(size, dtype=np.float32)))
        x = np.ones(size, dtype=np.float32)
        call = (lambda x=x: popmesh.broadcast(x, src=0)) if odd(w) else (lambda x=x: popmesh.all_reduce(x))
        expect_mismatch(call, "all_reduce(sum)", "broadcast(src=0)", ranks=range(n))
        warm(lambda size=size: popmesh.all_reduce(np.ones(size, dtype=np.float32)))
        call = (lambda x=x: popmesh.all_reduce(x, "min")) if odd(w) else (lambda x=x: popmesh.all_reduce(x))
        expect_mismatch(call, "all_reduce(sum)", "all_reduce(min)", ranks=range(n))
        still_works(w)


@check
def guarded_mismatch_at_the_overlap_boundary(w):
    """Calls without a sentinel (integer SUM) keep the guard round: on gloo before the payload below
    8 MiB and beside it from 8 MiB (engine.tuning.overlap_from_bytes), on MPI always beside once
    predicted. A mismatch on either side of the boundary raises on every rank."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    for size in ((8 << 20) // 4 - 1, (8 << 20) // 4):
        warm(lambda size=size: popmesh.all_reduce(np.full(size, r + 1, dtype=np.int32)))
        assert not carried(w) and predict(w.history) != 0
        x = np.full(size + (1 if odd(w) else 0), r + 1, dtype=np.int32)
        expect_mismatch(lambda x=x: popmesh.all_reduce(x), f"int32[{size}]", f"int32[{size + 1}]", ranks=range(n))
        out = popmesh.all_reduce(np.full(size, r + 1, dtype=np.int32))
        assert out[0] == total(n) and out[-1] == total(n)


@check
def flagged_data_is_not_a_mismatch(w):
    """A NaN or infinity in element 0 of real data (or an integer MAX at its extreme) looks like a
    sentinel: one guard round tells it apart, and the result is the engine's."""
    n, r = w.size, w.rank
    warm(lambda: popmesh.all_reduce(np.full(4, r + 1.0, dtype=np.float32)))
    for first in (np.nan, np.inf, -np.inf):
        x = np.full(4, r + 1.0, dtype=np.float32)
        x[0] = first if r == 0 else 1.0
        out = popmesh.all_reduce(x)
        assert (np.isnan(out[0]) if np.isnan(first) else out[0] == first) and np.all(out[1:] == total(n)), out
        assert carried(w), "still predicted"
    top = np.iinfo(np.int16).max
    warm(lambda: popmesh.all_reduce(np.full(3, r, dtype=np.int16), "max"))
    out = popmesh.all_reduce(np.full(3, top if r == 0 else r, dtype=np.int16), "max")
    assert out[0] == top and out.dtype == np.int16, out


@check
def every_rank_leaves_the_prediction_together(w):
    """All ranks change call at once (a pattern that changes): each rank first completes the predicted
    payload, then the guard agrees and the new call runs. Results stay exact, alternations too."""
    n, r = w.size, w.rank
    warm(lambda: popmesh.all_reduce(np.full(4, r + 1.0, dtype=np.float32)))
    for step in range(12):
        size = (4, 5, 1 << 18, 5)[step % 4]
        out = popmesh.all_reduce(np.full(size, r + 1.0, dtype=np.float32))
        assert out.shape == (size,) and np.all(out == total(n)), (step, out[:4])
    warm(lambda: popmesh.all_reduce(np.full(1 << 18, r + 1.0, dtype=np.float32)))
    h = popmesh.all_reduce_async(torch.full((8,), r + 1.0))  # asynchronous calls never carry their check
    assert torch.all(h.wait() == total(n))


@check
def asynchronous_against_a_carried_prediction(w):
    """An asynchronous call is another collective than the blocking one it may replace: a rank that
    starts one where the others repeat a predicted blocking call raises at once, as they do."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    warm(lambda: popmesh.all_reduce(torch.full((8,), r + 1.0)))
    x = torch.full((8,), r + 1.0)
    call = (lambda: popmesh.all_reduce_async(x).wait()) if odd(w) else (lambda: popmesh.all_reduce(x))
    expect_mismatch(call, "all_reduce(sum)", "all_reduce_async(sum)", ranks=range(n))
    still_works(w)


@check
def gathers_are_checked_like_reductions(w):
    """all_gather and gather go through the same check: against a reduction on another rank (unchecked,
    gloo aborts: the gathers' first message has another size), a predicted one included, and
    against another shape or root."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    x = np.full(4, r + 1.0, dtype=np.float32)
    call = (lambda: popmesh.all_gather(x)) if odd(w) else (lambda: popmesh.all_reduce(x))
    expect_mismatch(call, "all_gather()", "all_reduce(sum)", ranks=range(n))
    warm(lambda: popmesh.all_reduce(x))
    assert carried(w)
    expect_mismatch(call, "all_gather()", "all_reduce(sum)", ranks=range(n))
    for _ in range(3):
        out = popmesh.all_gather(x)
        assert out.shape == (n, 4) and out[:, 0].tolist() == [i + 1.0 for i in range(n)]
    y = np.ones(5 if odd(w) else 4, dtype=np.float32)
    expect_mismatch(lambda: popmesh.all_gather(y), "float32[4]", "float32[5]", ranks=range(n))
    expect_mismatch(lambda: popmesh.gather(x, dst=1 if odd(w) else 0), "gather(dst=0)", "gather(dst=1)",
                    ranks=range(n))
    out = popmesh.gather(x, dst=n - 1)
    assert (out is None) == (r != n - 1) and (out is None or out[:, 0].tolist() == [i + 1.0 for i in range(n)])
    still_works(w)


@check
def barrier_ragged_and_objects_are_checked(w):
    """barrier, all_gather_ragged and the object collectives go through the guard too: against a
    reduction (unchecked, MPI pairs a barrier with an all-reduce and returns garbage to it), a predicted
    one included, against each other, and against another root or trailing shape."""
    need_ranks(w, 2)
    n, r = w.size, w.rank
    x = np.full(4, r + 1.0, dtype=np.float32)

    def reduce():
        return popmesh.all_reduce(x)

    for other, text in ((popmesh.barrier, "barrier()"),
                        (lambda: popmesh.all_gather_ragged(np.ones((r + 1, 2))), "all_gather_ragged("),
                        (lambda: popmesh.all_gather_object({"r": r}), "all_gather_object()"),
                        (lambda: popmesh.broadcast_object("x", src=0), "broadcast_object(0)")):
        call = other if odd(w) else reduce
        expect_mismatch(call, text, "all_reduce(sum)", ranks=range(n))
        for _ in range(3):
            reduce()
            popmesh.barrier()
        assert predict(w.history) != 0
        expect_mismatch(call, text, "all_reduce(sum)", ranks=range(n))  # against a prediction
        still_works(w)
    call = (lambda: popmesh.all_gather_object(r)) if odd(w) else popmesh.barrier
    expect_mismatch(call, "barrier()", "all_gather_object()", ranks=range(n))
    call = (lambda: popmesh.broadcast_object(r, src=n - 1)) if odd(w) else (lambda: popmesh.broadcast_object(r))
    expect_mismatch(call, "broadcast_object(0)", f"broadcast_object({n - 1})", ranks=range(n))
    rows = np.ones((r, 3 if odd(w) else 2), dtype=np.float32)
    expect_mismatch(lambda: popmesh.all_gather_ragged(rows), "all_gather_ragged", ranks=range(n))
    for _ in range(3):  # and the correct calls work, repeated (predicted)
        popmesh.barrier()
        assert popmesh.all_gather_object(r) == list(range(n))
        assert popmesh.broadcast_object(r, src=n - 1) == n - 1
        parts = popmesh.all_gather_ragged(np.full((r, 2), r, dtype=np.float32))
        assert [p.shape[0] for p in parts] == list(range(n))
    still_works(w)
