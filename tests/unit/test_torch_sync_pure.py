"""popmesh.torch and popmesh.observe.stats in a world of one: layouts, views, hooks, re-planning, types.

Cross-rank behaviour is tested on real worlds in tests/world/; here the collectives are the identity,
so every check is about what happens on one rank.
"""

from __future__ import annotations

import contextlib
import gc
import io
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import itertools

import torch.distributed as dist

import popmesh
import popmesh.torch.sync as sync_module
from popmesh.core.errors import ConfigError
from popmesh.engines.base import Tuning
from popmesh.observe.stats import gather_rows, mean_std, reduce_value
from popmesh.torch import GradientSync, mean_grads_


def mlp(*widths: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in buffers)


@pytest.fixture
def launches(monkeypatch):
    """Every bucket buffer handed to all_reduce_async_, in order."""
    seen: list[torch.Tensor] = []
    real = sync_module.all_reduce_async_

    def record(buf, *args, **kwargs):
        seen.append(buf)
        return real(buf, *args, **kwargs)

    monkeypatch.setattr(sync_module, "all_reduce_async_", record)
    return seen


def test_gradients_become_bucket_views_and_stay_views():
    model = mlp(4, 8, 3)
    sync = GradientSync(model, cap_bytes=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for set_to_none in (True, False, True):
        opt.zero_grad(set_to_none=set_to_none)
        expected = torch.autograd.grad(model(torch.ones(2, 4)).sum(), list(model.parameters()))
        model(torch.ones(2, 4)).sum().backward()
        sync()
        for p, g in zip(model.parameters(), expected):
            assert inside(p.grad, sync.buffers) and torch.equal(p.grad, g)
    assert sum(b.numel() for b in sync.buffers) == sum(p.numel() for p in model.parameters())  # grads only
    views = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    model(torch.ones(2, 4)).sum().backward()
    sync()
    assert all(p.grad is v for p, v in zip(model.parameters(), views)), "steady state must not re-point grads"


def test_overlap_starts_buckets_during_backward_in_plan_order(launches):
    class Reordered(torch.nn.Module):  # uses its parameters in the opposite order they were registered
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.a(self.b(self.c(x)))

    model = Reordered()
    sync = GradientSync(model, cap_bytes=48, overlap=True)
    assert len(sync.plan.buckets) >= 3
    model(torch.ones(1, 3)).sum().backward()
    assert [b.data_ptr() for b in launches] == [b.data_ptr() for b in sync.buffers], "all buckets, plan order"
    sync()
    assert len(launches) == len(sync.buffers)


def test_without_overlap_or_inside_no_sync_nothing_starts_early(launches):
    model = mlp(3, 3, 3)
    sync = GradientSync(model, overlap=False)
    model(torch.ones(1, 3)).sum().backward()
    assert not launches
    sync()
    hooked = GradientSync(model, overlap=True)
    launches.clear()
    with hooked.no_sync():
        model(torch.ones(1, 3)).sum().backward()
    assert not launches
    hooked()
    assert len(launches) == len(hooked.buffers)


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_in_flight_limit_orders_starts_and_waits(monkeypatch, limit):
    events: list[str] = []
    real = sync_module.all_reduce_async_

    class Recorded:
        def __init__(self, handle, k):
            self.handle, self.k = handle, k

        def wait(self, timeout=None):
            events.append(f"wait{self.k}")
            return self.handle.wait(timeout)

    def start(buf, *args, **kwargs):
        k = sum(e.startswith("start") for e in events)
        events.append(f"start{k}")
        return Recorded(real(buf, *args, **kwargs), k)

    monkeypatch.setattr(sync_module, "all_reduce_async_", start)
    monkeypatch.setattr(popmesh.current_world().engine, "tuning", Tuning(max_in_flight=limit))
    model = mlp(3, 3, 3, 3)
    sync = GradientSync(model, cap_bytes=16, overlap=False)
    nb = len(sync.buffers)
    model(torch.ones(1, 3)).sum().backward()
    sync()
    assert sorted(events) == sorted([f"start{k}" for k in range(nb)] + [f"wait{k}" for k in range(nb)])
    for k in range(nb):  # bucket k starts only after bucket k - limit finished
        if limit and k >= limit:
            assert events.index(f"wait{k - limit}") < events.index(f"start{k}")
    if not limit:
        assert events[:nb] == [f"start{k}" for k in range(nb)]


def test_second_backward_during_reduction_is_reported():
    model = mlp(3, 2)
    sync = GradientSync(model, overlap=True)
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(ConfigError, match="no_sync"):
        model(torch.ones(1, 3)).sum().backward()
    sync()


def test_replans_when_parameters_change():
    model = mlp(3, 3)
    sync = GradientSync(model)
    first = sync.plan
    model.append(torch.nn.Linear(3, 2))
    model(torch.ones(1, 3)).sum().backward()
    sync()
    assert sync.plan is not first and len(sync.plan.specs) == 4
    model.double()
    model.zero_grad()
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    sync()
    assert {b.dtype for b in sync.plan.buckets} == {"float64"}
    assert all(p.grad.dtype == torch.float64 and inside(p.grad, sync.buffers) for p in model.parameters())
    model[0].requires_grad_(False)  # frozen layers leave the plan
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    sync()
    assert [s.name for s in sync.plan.specs] == ["1.weight", "1.bias"]


def test_parameters_with_no_gradient_anywhere_stay_none():
    model = mlp(3, 3, 3)
    sync = GradientSync(model)
    model[1](torch.ones(1, 3)).sum().backward()
    sync()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert model[1].weight.grad is not None


def test_mean_grads_cache_reuses_one_sync_and_does_not_keep_the_module_alive():
    model = mlp(3, 3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    mean_grads_(model)
    views = [p.grad for p in model.parameters()]
    mean_grads_(model)
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    ref = weakref.ref(model)
    del model, views, p
    gc.collect()
    assert ref() is None


def test_a_sync_keeps_its_module_alive():
    sync = GradientSync(mlp(2, 2))  # no other reference to the model
    gc.collect()
    sync()


def test_broadcast_params_checks_src_even_alone():
    from popmesh.torch import broadcast_params_

    broadcast_params_(mlp(2, 2), src=0)
    with pytest.raises(ConfigError, match="not in"):
        broadcast_params_(mlp(2, 2), src=1)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ConfigError, match="cap_bytes"):
        GradientSync(mlp(2, 2), cap_bytes=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GradientSync("model")
    emb = torch.nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(ConfigError, match="sparse"):
        GradientSync(emb)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=8),
       cap=st.integers(4, 200), overlap=st.booleans())
def test_packing_never_corrupts_gradients(shapes, cap, overlap):
    params = [torch.nn.Parameter(torch.randn(tuple(shape))) for shape in shapes]
    sync = GradientSync(params, cap_bytes=cap, overlap=overlap)
    loss = sum((p * (k + 1)).sum() for k, p in enumerate(params))
    loss.backward()
    sync()
    for k, p in enumerate(params):
        assert torch.equal(p.grad, torch.full_like(p, k + 1.0)) and inside(p.grad, sync.buffers)


# ---- stats --------------------------------------------------------------------------------------
def test_elementwise_results_never_alias_the_input():
    for x in (torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), {"a": torch.ones(2)}):
        out = reduce_value(x, "sum")
        if isinstance(x, dict):
            assert out is not x and out["a"] is not x["a"]
        else:
            assert out is not x
            out[0] = 99
            assert x[0] == 1


def test_elementwise_types_and_op_spellings():
    assert type(reduce_value(3, "sum")) is int and type(reduce_value(3, "avg")) is float
    assert reduce_value(3, "avg") == 3.0 and isinstance(reduce_value(np.int32(3), "avg"), np.float64)
    assert reduce_value(np.float16(1.5), "sum").dtype == np.float16
    assert reduce_value(torch.tensor([2, 3]), "avg").is_floating_point()
    assert reduce_value(torch.tensor([1.0]), dist.ReduceOp.MIN).item() == 1.0
    with pytest.raises(ConfigError):
        reduce_value(1.0, "median")


def test_statistics_are_stable_and_typed():
    rng = np.random.default_rng(0)
    x = 1e9 + rng.standard_normal(1000)  # E[x^2] - E[x]^2 would lose every digit here
    mean, std, lo, hi = mean_std(x, with_min_max=True)
    assert np.isclose(std, x.std(), rtol=1e-9) and mean == pytest.approx(x.mean(), rel=1e-15)
    assert (lo, hi) == (x.min(), x.max())
    t = mean_std(torch.tensor([1.0, 3.0], dtype=torch.float16))
    assert [v.dtype for v in t] == [torch.float16] * 2 and t[0].item() == 2.0 and t[1].item() == 1.0
    assert all(np.isnan(v) for v in mean_std([], True))


def test_gather_rows_of_lists_and_errors():
    assert gather_rows([1, 2, 3]).tolist() == [1, 2, 3]
    assert gather_rows([torch.ones(2), torch.zeros(2)]).shape == (2, 2)
    local = torch.arange(4)
    out = gather_rows(local)
    assert torch.equal(out, local) and out is not local
    with pytest.raises(ConfigError, match="1-d"):
        gather_rows(torch.tensor(1.0))
    with pytest.raises(TypeError):
        gather_rows([torch.ones(1), 1.0])
    with pytest.raises(ConfigError, match="not in"):
        gather_rows(local, dst=3)


def test_omnisafe_setup_distributed_prints_once():
    import popmesh.compat.omnisafe as omnisafe

    omnisafe._ANNOUNCED = False
    threads = torch.get_num_threads()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert omnisafe.setup_distributed() is None and torch.get_num_threads() >= 1
            omnisafe.setup_distributed()
    finally:
        torch.set_num_threads(threads)
    assert len(out.getvalue().splitlines()) == 1 and "thread" in out.getvalue()
