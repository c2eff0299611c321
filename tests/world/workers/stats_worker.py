"""Checks of popmesh.observe.stats (and OmniSafe's in-place and thread helpers) on a real world; rank r
contributes r + 1 so results have closed forms."""

import contextlib
import io
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.omnisafe as omnisafe
from popmesh import CollectiveMismatch, ConfigError, NotInGroup, ReduceOp
from popmesh.observe.stats import gather_rows, mean_std, reduce_value
from worldlib import check, main

torch.set_num_threads(1)

LENGTHS = {1: [5], 2: [0, 5], 3: [0, 5, 7]}  # rank r holds LENGTHS[n][r] elements


def total(n):
    return n * (n + 1) // 2


def ragged_values(r, length):
    """Rank r's share: a large offset plus a small spread, so a one-pass variance would cancel."""
    return 1000.0 + (r + 1) * np.sin(np.arange(length) + 3 * r)


@check
def elementwise_torch_keeps_dtype_and_input(w):
    n, r = w.size, w.rank
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        x = torch.tensor([r + 1, -(r + 1)], dtype=dtype)
        before = x.clone()
        s, mx, mn = reduce_value(x, "sum"), reduce_value(x, "max"), reduce_value(x, "min")
        assert s.dtype == dtype and s.tolist() == [total(n), -total(n)], (dtype, s)
        assert mx.tolist() == [n, -1] and mn.tolist() == [1, -n], (mx, mn)
        assert torch.equal(x, before), "the caller's tensor must not be overwritten (OmniSafe aliased it)"
        assert s is not x and s.data_ptr() != x.data_ptr()
    f = torch.tensor([r + 1.0])
    avg = reduce_value(f, "avg")
    assert avg.dtype == torch.float32 and avg.item() == (n + 1) / 2 and f.item() == r + 1
    ints = reduce_value(torch.tensor([r + 1]), "avg")
    assert ints.is_floating_point() and ints.item() == (n + 1) / 2, "an average of integers is not floored"


@check
def elementwise_scalars_and_numpy(w):
    n, r = w.size, w.rank
    assert reduce_value(r + 1, "sum") == total(n) and type(reduce_value(r + 1, "sum")) is int
    m = reduce_value(float(r + 1), "max")
    assert m == float(n) and type(m) is float
    assert reduce_value(r + 1, "avg") == (n + 1) / 2 and type(reduce_value(r + 1, "avg")) is float
    s = reduce_value(np.float32(r + 1), "sum")
    assert isinstance(s, np.float32) and s == total(n)
    a = np.array([[r + 1, 2 * (r + 1)]], dtype=np.int16)
    out = reduce_value(a, "sum")
    assert out.dtype == np.int16 and out.tolist() == [[total(n), 2 * total(n)]] and a[0, 0] == r + 1
    z = reduce_value(torch.tensor(float(r + 1)), "min")
    assert z.ndim == 0 and z.item() == 1.0


@check
def reduce_value_accepts_every_op_spelling(w):
    n, r = w.size, w.rank
    x = torch.tensor([r + 1.0])
    for op in (ReduceOp.MAX, "max", "MAX", dist.ReduceOp.MAX):
        assert reduce_value(x, op).item() == n, op
    assert reduce_value(x, dist.ReduceOp.SUM).item() == total(n)
    assert reduce_value(x, "mean").item() == (n + 1) / 2
    try:
        reduce_value(x, dist.ReduceOp.BAND)
    except ConfigError as e:
        assert "unknown reduce op" in str(e)
    else:
        raise AssertionError("BAND is not a popmesh reduction")


@check
def statistics_ragged_lengths_against_numpy(w):
    n, r = w.size, w.rank
    lengths = LENGTHS[n]
    everything = np.concatenate([ragged_values(i, k) for i, k in enumerate(lengths)])
    want = (everything.mean(), everything.std(), everything.min(), everything.max())
    local = ragged_values(r, lengths[r])
    got64 = mean_std(torch.tensor(local), with_min_max=True)
    assert all(isinstance(g, torch.Tensor) and g.ndim == 0 and g.dtype == torch.float64 for g in got64)
    assert np.allclose([g.item() for g in got64], want, rtol=1e-12, atol=0), (got64, want)
    got32 = mean_std(torch.tensor(local, dtype=torch.float32), True)
    assert all(g.dtype == torch.float32 for g in got32)
    assert np.allclose([g.item() for g in got32], want, rtol=1e-5), (got32, want)
    gotnp = mean_std(local, with_min_max=True)
    assert all(isinstance(g, np.float64) for g in gotnp) and np.allclose(gotnp, want, rtol=1e-12)
    gotlist = mean_std(local.tolist())
    assert len(gotlist) == 2 and all(type(g) is float for g in gotlist)
    assert np.allclose(gotlist, want[:2], rtol=1e-12)


@check
def statistics_min_max_are_global_scalars(w):
    n, r = w.size, w.rank
    x = torch.arange(r + 1, dtype=torch.float32) * (r + 1)  # different lengths; OmniSafe needed equal ones
    mean, std, lo, hi = mean_std(x, with_min_max=True)
    everything = np.concatenate([np.arange(i + 1) * (i + 1) for i in range(n)]).astype(np.float64)
    assert lo.item() == 0.0 and hi.item() == n * (n - 1)
    assert abs(mean.item() - everything.mean()) < 1e-5 and abs(std.item() - everything.std()) < 1e-5
    ints = mean_std(torch.full((2,), r + 1), True)
    assert ints[0].dtype == torch.get_default_dtype() and ints[2].item() == 1 and ints[3].item() == n


@check
def statistics_with_a_nan_are_nan(w):
    """The last rank holds a NaN: every statistic is NaN on every rank, as numpy's (the std was 0.0, and
    min/max were finite under gloo and differed between MPI ranks). Infinities without a NaN keep their
    min/max; their std is NaN."""
    n, r = w.size, w.rank
    values = [float(r + 1), math.nan if r == n - 1 else -float(r + 1)]
    for got in (mean_std(torch.tensor(values), True), mean_std(np.array(values), True), mean_std(values, True),
                omnisafe.dist_statistics_scalar(torch.tensor(values), with_min_and_max=True)):
        assert all(math.isnan(float(g)) for g in got), (r, got)
    infinite = [math.inf if r == 0 else 1.0, -math.inf if r == n - 1 else 1.0]
    mean, std, lo, hi = mean_std(np.array(infinite), True)
    assert math.isnan(mean) and math.isnan(std) and (lo, hi) == (-math.inf, math.inf), (mean, std, lo, hi)


@check
def statistics_of_nothing_are_nan(w):
    got = mean_std(torch.zeros(0), with_min_max=True)
    assert all(torch.isnan(g) for g in got)


@check
def omnisafe_avg_tensor_in_place(w):
    n, r = w.size, w.rank
    t = torch.full((3,), r + 1.0)
    assert omnisafe.avg_tensor(t) is None and torch.allclose(t, torch.full((3,), (n + 1) / 2))
    s = torch.tensor(float(r + 1))  # 0-d works at every world size (OmniSafe rejected it when n > 1)
    omnisafe.avg_tensor(s)
    assert s.item() == (n + 1) / 2
    try:
        omnisafe.avg_tensor(torch.tensor([r + 1]))
    except ConfigError as e:
        assert "dist_avg" in str(e)
    else:
        raise AssertionError("an integer tensor cannot hold an average in place")


@check
def gather_uint8_with_sizes_over_255(w):
    n, r = w.size, w.rank
    rows = [300 + 17 * i for i in range(n)]
    local = torch.full((rows[r], 2, 3), r + 1, dtype=torch.uint8)
    out = gather_rows(local)
    if r == 0:
        assert out.dtype == torch.uint8 and out.shape == (sum(rows), 2, 3), out.shape
        expected = torch.cat([torch.full((k, 2, 3), i + 1, dtype=torch.uint8) for i, k in enumerate(rows)])
        assert torch.equal(out, expected)
    else:
        assert out is None
    half = np.full((2100 + r, 1), r + 1, dtype=np.float16)  # float16 sizes broke above 2048
    got = gather_rows(half, dst=n - 1)
    if r == n - 1:
        assert got.dtype == np.float16 and got.shape == (sum(2100 + i for i in range(n)), 1)
        assert got[:2100, 0].tolist() == [1.0] * 2100 and got[-1, 0] == n
    else:
        assert got is None


@check
def gather_lists_empty_ranks_and_groups(w):
    n, r = w.size, w.rank
    out = gather_rows([float(r)] * r)  # rank 0 holds no rows
    if r == 0:
        assert out.tolist() == [float(i) for i in range(n) for _ in range(i)]
    rows = gather_rows([torch.tensor([r, r + 1])] * 2)  # each entry is one row
    if r == 0:
        assert rows.shape == (2 * n, 2) and rows[::2, 0].tolist() == list(range(n))
    if n > 1:
        try:
            gather_rows(torch.zeros(2, 2 + (r == n - 1)))
        except CollectiveMismatch as e:
            assert "trailing" in str(e)
        else:
            raise AssertionError("different trailing shapes must raise on every rank")
    g = w.new_group([n - 1])
    if g.is_member:
        mine = gather_rows(torch.arange(3), group=g)
        assert mine.tolist() == [0, 1, 2]


@check
def statistics_over_a_subgroup(w):
    n, r = w.size, w.rank
    members = list(range(1, n)) or [0]
    g = w.new_group(members)
    if not g.is_member:
        try:
            reduce_value(1.0, "sum", group=g)
        except NotInGroup:
            return  # the idle rank calls nothing else
        raise AssertionError("non-members must get NotInGroup")
    mean, std, lo, hi = mean_std(np.full(r + 1, float(r + 1)), True, group=g)
    values = np.concatenate([np.full(m + 1, float(m + 1)) for m in members])
    assert np.isclose(mean, values.mean()) and np.isclose(std, values.std())
    assert lo == min(m + 1 for m in members) and hi == max(m + 1 for m in members)
    assert reduce_value(float(r + 1), "avg", group=g) == sum(m + 1 for m in members) / len(members)


@check
def omnisafe_setup_distributed_shares_cores(w):
    cores = len(os.sched_getaffinity(0))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert omnisafe.setup_distributed() is None
        omnisafe.setup_distributed()
    assert torch.get_num_threads() == max(1, cores // w.local_size)
    lines = printed.getvalue().splitlines()
    assert len(lines) == (1 if w.is_main else 0), lines
    torch.set_num_threads(1)


@check
def progress_reports_reach_rank_0(w):
    """popmesh.Progress: every rank reports its steps; after close() rank 0 has each rank's last step and
    numbers (the throttled-away last update too) and prints one line naming all of them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        progress = popmesh.Progress(total=40, title="loop", live=False, send_every_s=10.0, final_wait_s=20.0)
        for step in range(1, 41):
            progress.update(step, loss=1.0 / step, rank_value=w.rank + 1)
        progress.close()
    if w.rank != 0:
        return
    assert sorted(progress.rows) == list(range(w.size)), progress.rows
    assert all(row["step"] == 40 and row["rank_value"] == r + 1 for r, row in progress.rows.items()), progress.rows
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("[loop] r0 step 40/40 (100%)") and f"r{w.size - 1} step 40/40" in last, last


if __name__ == "__main__":
    main()
