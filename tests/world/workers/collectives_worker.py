"""Checks of every collective on a real world; rank r contributes r + 1 so results have closed forms."""

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import CollectiveMismatch, ConfigError, NotInGroup
from worldlib import check, main

try:
    import torch
except ImportError:  # pragma: no cover - torch is part of the test environment
    torch = None


def total(n):
    return n * (n + 1) // 2


@check
def world_facts(w):
    assert w.size == int(os.environ.get("EXPECT_SIZE", w.size))
    assert 0 <= w.rank < w.size and w.is_main == (w.rank == 0)
    assert len(w.hostnames) == w.size and w.hostname in w.hostnames
    assert 0 <= w.local_rank < w.local_size <= w.size


@check
def all_reduce_numpy_dtypes(w):
    n, r = w.size, w.rank
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8, np.complex64):
        x = np.full((2, 3), r + 1, dtype=dtype)
        out = popmesh.all_reduce(x)
        assert out.dtype == dtype and out.shape == (2, 3), (dtype, out.dtype)
        assert np.all(out == total(n)), (dtype, out)
        assert np.all(x == r + 1), "input must be untouched"


@check
def all_reduce_ops(w):
    n, r = w.size, w.rank
    x = np.array([r + 1.0, -(r + 1.0)])
    assert np.allclose(popmesh.all_reduce(x, "avg"), [(n + 1) / 2, -(n + 1) / 2])
    assert np.allclose(popmesh.all_reduce(x, "max"), [n, -1])
    assert np.allclose(popmesh.all_reduce(x, "min"), [1, -n])
    assert np.allclose(popmesh.all_reduce(x, popmesh.ReduceOp.PROD), [math.factorial(n), (-1) ** n * math.factorial(n)])
    ints = popmesh.all_reduce(np.array([r + 1], dtype=np.int64), "avg")
    assert ints.dtype == np.int64 and ints[0] == total(n) // n


@check
def all_reduce_bool(w):
    r = w.rank
    flags = np.array([r == 0, True, False])
    assert popmesh.all_reduce(flags, "max").tolist() == [True, True, False]
    assert popmesh.all_reduce(flags, "min").tolist() == [w.size == 1, True, False]
    assert popmesh.all_reduce(flags, "sum").dtype == np.bool_


@check
def all_reduce_scalars(w):
    n, r = w.size, w.rank
    out = popmesh.all_reduce(r + 1)
    assert out == total(n) and type(out) is int
    avg = popmesh.all_reduce(float(r + 1), "avg")
    assert type(avg) is float and abs(avg - (n + 1) / 2) < 1e-12
    assert popmesh.all_reduce(np.float32(r + 1)).dtype == np.float32


@check
def all_reduce_torch_dtypes(w):
    n, r = w.size, w.rank
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        x = torch.full((4,), r + 1, dtype=dtype)
        out = popmesh.all_reduce(x)
        assert out.dtype == dtype and out.device == x.device
        assert torch.all(out == total(n)), (dtype, out)
        assert torch.all(x == r + 1)
    b = popmesh.all_reduce(torch.tensor([r == 0, True]), "min")
    assert b.dtype == torch.bool and b.tolist() == [n == 1, True]


@check
def all_reduce_nested_and_fused(w):
    n, r = w.size, w.rank
    tree = {"a": np.full(3, r + 1.0), "b": [torch.full((2, 2), r + 1.0), (np.int64(r + 1), r + 1)],
            "c": torch.full((5,), r + 1.0)}
    out = popmesh.all_reduce(tree, "sum")
    assert set(out) == {"a", "b", "c"} and isinstance(out["b"], list) and isinstance(out["b"][1], tuple)
    assert np.all(out["a"] == total(n)) and torch.all(out["b"][0] == total(n)) and torch.all(out["c"] == total(n))
    assert out["b"][1][0] == total(n) and out["b"][1][1] == total(n) and type(out["b"][1][1]) is int
    assert np.all(tree["a"] == r + 1) and torch.all(tree["c"] == r + 1)


@check
def all_reduce_in_place(w):
    n, r = w.size, w.rank
    a, t = np.full(3, r + 1.0), torch.full((2,), r + 1.0)
    result = popmesh.all_reduce_({"a": a, "t": t}, "avg")
    assert result["a"] is a and np.allclose(a, (n + 1) / 2) and torch.allclose(t, torch.tensor((n + 1) / 2))
    strided = np.full((4, 4), r + 1.0).T[::2]
    popmesh.all_reduce_(strided)
    assert np.all(strided == total(n))
    try:
        popmesh.all_reduce_(3)
    except TypeError:
        pass
    else:
        raise AssertionError("in-place reduction of a scalar must raise TypeError")


@check
def all_gather_stacked_and_concat(w):
    n, r = w.size, w.rank
    out = popmesh.all_gather(np.full(3, r + 1, dtype=np.int32))
    assert out.shape == (n, 3) and out.dtype == np.int32
    assert out[:, 0].tolist() == list(range(1, n + 1))
    cat = popmesh.all_gather(torch.full((2, 2), r + 1.0, dtype=torch.bfloat16), concat=True)
    assert cat.shape == (2 * n, 2) and cat.dtype == torch.bfloat16 and cat[::2, 0].tolist() == list(range(1, n + 1))
    scalars = popmesh.all_gather(r + 1)
    assert scalars == list(range(1, n + 1))
    both = popmesh.all_gather({"x": np.array([r]), "y": [torch.tensor([r * 2])]})
    assert both["x"][:, 0].tolist() == list(range(n)) and both["y"][0][:, 0].tolist() == [2 * i for i in range(n)]


@check
def all_gather_shape_mismatch_detected(w):
    if w.size == 1:
        return
    try:
        popmesh.all_gather(np.zeros(w.rank + 1))
    except CollectiveMismatch as e:
        assert "rank 0" in str(e) and f"rank {w.size - 1}" in str(e), str(e)
    else:
        raise AssertionError("different shapes in all_gather must raise CollectiveMismatch")


@check
def all_gather_ragged(w):
    n, r = w.size, w.rank
    local = np.arange(r * 2, dtype=np.int16).reshape(r, 2)
    pieces = popmesh.all_gather_ragged(local)
    assert len(pieces) == n
    for i, p in enumerate(pieces):
        assert p.shape == (i, 2) and p.dtype == np.int16 and p.ravel().tolist() == list(range(i * 2))
    tp = popmesh.all_gather_ragged(torch.arange(r, dtype=torch.float64))
    assert [t.tolist() for t in tp] == [list(map(float, range(i))) for i in range(n)]


@check
def broadcast_from_last(w):
    n, r = w.size, w.rank
    src = n - 1
    x = {"w": np.full(3, r + 1.0), "t": torch.full((2,), r + 1, dtype=torch.int64)}
    out = popmesh.broadcast(x, src=src)
    assert np.all(out["w"] == n) and torch.all(out["t"] == n) and np.all(x["w"] == r + 1)
    popmesh.broadcast_(x, src=0)
    assert np.all(x["w"] == 1) and torch.all(x["t"] == 1)
    assert popmesh.broadcast(float(r), src=src) == float(src)
    obj = popmesh.broadcast_object({"lr": 0.1, "rank": r} if r == src else None, src=src)
    assert obj == {"lr": 0.1, "rank": src}


@check
def gather_to_last(w):
    n, r = w.size, w.rank
    out = popmesh.gather(np.full(2, r + 1.0), dst=n - 1)
    if r == n - 1:
        assert out.shape == (n, 2) and out[:, 1].tolist() == list(map(float, range(1, n + 1)))
    else:
        assert out is None
    objs = popmesh.gather_object({"r": r}, dst=0)
    assert (objs == [{"r": i} for i in range(n)]) if r == 0 else objs is None


@check
def reduce_scatter(w):
    n, r = w.size, w.rank
    x = np.arange(2 * n, dtype=np.float64) * (r + 1)
    out = popmesh.reduce_scatter(x)
    assert out.tolist() == [float(v * total(n)) for v in range(2 * r, 2 * r + 2)]
    t = popmesh.reduce_scatter(torch.ones(n, 3) * (r + 1), "avg")
    assert t.shape == (1, 3) and torch.allclose(t, torch.full((1, 3), (n + 1) / 2))
    try:
        popmesh.reduce_scatter(np.zeros(n + 1))
    except ConfigError:
        assert n > 1
    else:
        assert n == 1


@check
def objects(w):
    n, r = w.size, w.rank
    got = popmesh.all_gather_object({"rank": r, "name": f"agent-{r}", "ret": [r * 1.5]})
    assert got == [{"rank": i, "name": f"agent-{i}", "ret": [i * 1.5]} for i in range(n)]
    try:
        popmesh.all_gather_object({1, 2})
    except popmesh.MessageError as e:
        assert "allow_pickle" in str(e)
    else:
        raise AssertionError("a set is not JSON-able and must need allow_pickle")
    assert popmesh.all_gather_object({r}, allow_pickle=True) == [{i} for i in range(n)]


def _marker(round_, rank):
    return os.path.join(os.environ["POPMESH_TEST_OUT"], f"barrier-{round_}-rank{rank}")


@check
def barrier(w):
    """No rank leaves a barrier before every rank reached it: each round one rank arrives late (the last,
    the first, then the last of a sub-group), every rank leaves a marker just before the barrier, and
    after it every marker must be there."""
    popmesh.barrier()
    popmesh.barrier(timeout=10)
    pair = w.new_group(sorted({0, w.size - 1}))
    rounds = [(w.size - 1, w), (0, w), (w.size - 1, pair)]
    for round_, (late, group) in enumerate(rounds):
        if not group.is_member:
            continue
        if w.rank == late:
            time.sleep(0.1)
        with open(_marker(round_, w.rank), "w") as f:
            f.write(str(time.time()))
        popmesh.barrier(group=group, timeout=10)
        missing = [g for g in group.ranks if not os.path.exists(_marker(round_, g))]
        assert not missing, f"round {round_}: the barrier returned before ranks {missing} reached it"


@check
def fast_paths_equal_the_tree_paths(w):
    """One array or tensor takes a short way past the tree machinery, and a structure fuses its leaves
    into one buffer per dtype: both give what each leaf reduced (or broadcast) alone gives."""
    r, n = w.rank, w.size
    leaves = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1), np.array([r + 1, -(r + 1)], np.int64),
              np.full((3, 2), r + 1.5).T, np.array([r == 0, True, False]), np.arange(3, dtype=np.float16) + r,
              np.float32(r + 1), torch.arange(4, dtype=torch.float64) - r,
              torch.tensor([r + 0.5], dtype=torch.bfloat16),
              torch.arange(6, dtype=torch.float32).reshape(2, 3).T * (r + 1), torch.tensor([r % 2 == 0, True])]
    for op in ("sum", "avg", "max", "min", "prod"):
        usable = [x for x in leaves if not (op == "avg" and x.dtype in (np.bool_, torch.bool))]
        singles = [popmesh.all_reduce(x, op) for x in usable]
        for structured in (popmesh.all_reduce(list(usable), op), popmesh.all_reduce({"k": tuple(usable)}, op)["k"]):
            for one, other in zip(singles, structured):
                _same(one, other, op)
        in_place = [_copy(x) for x in usable if not isinstance(x, np.generic)]
        popmesh.all_reduce_(in_place, op)
        for x, got in zip([x for x in usable if not isinstance(x, np.generic)], in_place):
            alone = _copy(x)
            popmesh.all_reduce_(alone, op)
            _same(alone, got, op)
    singles = [popmesh.broadcast(x, src=n - 1) for x in leaves]
    for one, other in zip(singles, popmesh.broadcast(list(leaves), src=n - 1)):
        _same(one, other, "broadcast")


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else np.array(x, copy=True)


def _same(one, other, what):
    assert type(one) is type(other) and one.dtype == other.dtype and one.shape == other.shape, (what, one, other)
    equal = torch.equal(one, other) if isinstance(one, torch.Tensor) else np.array_equal(one, other)
    assert equal, (what, one, other)


@check
def subgroup_average(w):
    n, r = w.size, w.rank
    members = [0, n - 1] if n > 1 else [0]
    g = w.new_group(members)
    assert g.size == len(members) and g.is_member == (r in members)
    if g.is_member:
        out = popmesh.all_reduce(np.array([r + 1.0]), "avg", group=g)
        assert np.allclose(out, sum(m + 1 for m in members) / len(members))
        assert popmesh.broadcast(np.array([r]), src=members[-1], group=g)[0] == members[-1]
        assert popmesh.all_gather(np.array([r]), group=g)[:, 0].tolist() == members
        try:
            popmesh.broadcast(np.array([r]), src=1, group=g) if 1 not in members else None
        except ConfigError as e:
            assert "not in group" in str(e)
    else:
        try:
            popmesh.all_reduce(np.ones(1), group=g)
        except NotInGroup as e:
            assert f"rank {r}" in str(e)
        else:
            raise AssertionError("a non-member must get NotInGroup")
    popmesh.barrier()


@check
def check_mode_mismatch(w):
    if w.size == 1:
        return
    w.check_mode = True
    try:
        popmesh.all_reduce(np.zeros(2 + (w.rank == w.size - 1), dtype=np.float32))
    except CollectiveMismatch as e:
        text = str(e)
        assert "float32[2]" in text and "float32[3]" in text and "rank 0" in text, text
        assert set(e.per_rank) == set(range(w.size))
    else:
        raise AssertionError("check mode must detect a shape mismatch")
    try:
        popmesh.all_reduce(np.zeros(2), "sum" if w.rank else "max")
    except CollectiveMismatch as e:
        assert "max" in str(e) and "sum" in str(e)
    else:
        raise AssertionError("check mode must detect an op mismatch")
    out = popmesh.all_reduce({"a": np.ones(2)})
    assert np.all(out["a"] == w.size)
    w.check_mode = False


@check
def all_reduce_async_overlap(w):
    n, r = w.size, w.rank
    bufs = [torch.full((1000,), r + 1.0), np.full(7, r + 1, dtype=np.int64), torch.tensor([r == 0, True])]
    handles = [popmesh.all_reduce_async_(bufs[0], "avg"), popmesh.all_reduce_async_(bufs[1]),
               popmesh.all_reduce_async_(bufs[2], "min")]
    copy = popmesh.all_reduce_async(np.full(3, r + 1.0), "max")
    assert all(isinstance(h.done(), bool) for h in handles)
    assert handles[0].wait() is bufs[0] and torch.allclose(bufs[0], torch.full((1000,), (n + 1) / 2))
    assert handles[1].wait() is bufs[1] and np.all(bufs[1] == total(n))
    assert handles[2].wait().tolist() == [n == 1, True]
    assert copy.wait().tolist() == [float(n)] * 3 and copy.done()


if __name__ == "__main__":
    main()
