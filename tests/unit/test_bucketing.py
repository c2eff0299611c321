"""Unit tests for bucket plans (pure layout of gradient buckets)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.dtypes import itemsize
from popmesh.core.errors import ConfigError
from popmesh.torch.bucketing import (
    DEFAULT_CAP_BYTES,
    BucketPlan,
    ParamSpec,
    plan_buckets,
    plan_differs,
)

FAST = settings(max_examples=80, deadline=None)

spec_lists = st.lists(
    st.tuples(st.integers(0, 300), st.sampled_from(["float32", "float16", "float64", "torch.bfloat16", "int8"]),
              st.sampled_from(["cpu", "cuda:0"])),
    max_size=25,
).map(lambda rows: [ParamSpec(f"p{i}", n, dt, dev) for i, (n, dt, dev) in enumerate(rows)])


def _check_plan(plan: BucketPlan, cap: int, align: int) -> None:
    specs = plan.specs
    seen = sorted(i for b in plan.buckets for i in b.indices)
    assert seen == list(range(len(specs)))                                   # each exactly once
    for b in plan.buckets:
        size = itemsize(b.dtype)
        assert b.indices and len(b.indices) == len(b.offsets) == len(b.sizes)
        end = 0
        for i, off, n in zip(b.indices, b.offsets, b.sizes):
            assert specs[i].dtype == b.dtype and specs[i].device == b.device and specs[i].numel == n
            assert off >= end                                                 # disjoint, increasing
            if align >= size:
                assert (off * size) % align == 0
            end = off + n
        assert end == b.numel
        if align == 0:
            assert sum(b.sizes) == b.numel
        assert b.nbytes <= cap or len(b.indices) == 1
        assert all(plan.locate(i) == (plan.buckets.index(b), off) for i, off in zip(b.indices, b.offsets))


@FAST
@given(spec_lists, st.integers(1, 2000), st.sampled_from([0, 8, 64]), st.sampled_from(["reverse", "forward"]))
def test_plan_properties(specs, cap, align, order):
    plan = plan_buckets(specs, cap_bytes=cap, order=order, align_bytes=align)
    _check_plan(plan, cap, align)
    step = -1 if order == "reverse" else 1
    for b in plan.buckets:
        assert list(b.indices) == sorted(b.indices, reverse=step < 0)
    assert plan == plan_buckets(specs, cap_bytes=cap, order=order, align_bytes=align)
    assert plan.fingerprint() == plan_buckets(specs, cap_bytes=cap, order=order, align_bytes=align).fingerprint()


@FAST
@given(spec_lists, st.integers(1, 2000))
def test_greedy_buckets_are_full(specs, cap):
    """A bucket is only closed when its (dtype, device) successor would not fit."""
    plan = plan_buckets(specs, cap_bytes=cap)
    by_key: dict[tuple[str, str], list] = {}
    for b in plan.buckets:
        by_key.setdefault((b.dtype, b.device), []).append(b)
    for buckets in by_key.values():
        for prev, nxt in itertools.pairwise(buckets):
            assert min(prev.indices) > max(nxt.indices)                       # reverse ready order
            assert (prev.numel + nxt.sizes[0]) * itemsize(prev.dtype) > cap


def test_reverse_order_and_cap():
    specs = [ParamSpec(f"l{i}", 1000, "float32") for i in range(5)]          # 4000 bytes each
    plan = plan_buckets(specs, cap_bytes=8000)
    assert [b.indices for b in plan.buckets] == [(4, 3), (2, 1), (0,)]
    assert [b.offsets for b in plan.buckets] == [(0, 1000), (0, 1000), (0,)]
    fwd = plan_buckets(specs, cap_bytes=8000, order="forward")
    assert [b.indices for b in fwd.buckets] == [(0, 1), (2, 3), (4,)]


def test_large_parameter_gets_own_bucket_and_groups_by_dtype_device():
    specs = [ParamSpec("a", 10, "float32"), ParamSpec("big", 10**6, "float32"), ParamSpec("c", 10, "float32"),
             ParamSpec("h", 10, "float16"), ParamSpec("g", 10, "float32", "cuda:0")]
    plan = plan_buckets(specs, cap_bytes=1024)
    assert [(b.dtype, b.device, b.indices) for b in plan.buckets] == [
        ("float32", "cuda:0", (4,)), ("float16", "cpu", (3,)), ("float32", "cpu", (2,)),
        ("float32", "cpu", (1,)), ("float32", "cpu", (0,))]


def test_alignment_pads_to_boundary():
    specs = [ParamSpec("a", 3, "float32"), ParamSpec("b", 5, "float32"), ParamSpec("c", 1, "float64")]
    plan = plan_buckets(specs, order="forward", align_bytes=64)
    f32 = plan.buckets[0]
    assert f32.offsets == (0, 16) and f32.numel == 21 and f32.nbytes == 84
    assert plan_buckets(specs, order="forward").buckets[0].offsets == (0, 3)


def test_default_cap_is_25_mib_and_empty_plan():
    plan = plan_buckets([])
    assert plan.cap_bytes == DEFAULT_CAP_BYTES == 25 * 2**20 and plan.buckets == ()
    assert len(plan_buckets([("w", 2**20, "float32"), ("b", 2**20, "float32")]).buckets) == 1


def test_fingerprint_ignores_device_index_but_not_layout():
    base = [ParamSpec("w", 100, "float32", "cuda:0"), ParamSpec("b", 10, "float32", "cuda:0")]
    other_gpu = [ParamSpec(s.name, s.numel, s.dtype, "cuda:3") for s in base]
    fp = plan_buckets(base).fingerprint()
    assert len(fp) == 16 and fp == plan_buckets(other_gpu).fingerprint()
    assert fp != plan_buckets([base[0], ParamSpec("b", 11, "float32", "cuda:0")]).fingerprint()
    assert fp != plan_buckets(base, cap_bytes=100).fingerprint()
    assert fp != plan_buckets(base[::-1]).fingerprint()
    assert fp != plan_buckets([ParamSpec(s.name, s.numel, s.dtype, "cpu") for s in base]).fingerprint()


def test_to_dict_is_json_and_dtype_names_normalised():
    plan = plan_buckets([("w", 4, "torch.float32", "cpu")])
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["params"] == [{"name": "w", "numel": 4, "dtype": "float32", "device": "cpu"}]
    assert data["buckets"][0]["indices"] == [0]
    assert plan.fingerprint() == plan_buckets([("w", 4, "float32")]).fingerprint()


def test_plan_differs():
    specs = [ParamSpec("w", 4, "float32"), ParamSpec("b", 2, "float32")]
    plan = plan_buckets(specs)
    assert not plan_differs(plan, list(specs))
    assert not plan_differs(plan, [("w", 4, "torch.float32"), ("b", 2, "float32", "cpu")])
    assert plan_differs(plan, specs[::-1])
    assert plan_differs(plan, [specs[0], ParamSpec("b", 2, "float32", "cuda:0")])
    assert plan_differs(plan, specs[:1])


def test_param_spec_from_array_duck_types():
    spec = ParamSpec.from_array("x", np.zeros((3, 4), np.float16))
    assert spec == ParamSpec("x", 12, "float16", "cpu") and spec.nbytes == 24

    class FakeTensor:
        dtype, device = "torch.bfloat16", "cuda:1"

        def numel(self) -> int:
            return 7

    assert ParamSpec.from_array("t", FakeTensor()) == ParamSpec("t", 7, "bfloat16", "cuda:1")
    assert itemsize("float8_e4m3fn") == 1 and itemsize("complex128") == 16


@pytest.mark.parametrize("call, match", [
    (lambda: ParamSpec("x", -1, "float32"), "numel"),
    (lambda: ParamSpec("x", 1.5, "float32"), "numel"),
    (lambda: ParamSpec("x", 1, "float"), "unknown dtype"),
    (lambda: ParamSpec("x", 1, "float32", ""), "device"),
    (lambda: ParamSpec(3, 1, "float32"), "name"),
    (lambda: plan_buckets([("a", 1, "float32"), ("a", 2, "float32")]), "unique"),
    (lambda: plan_buckets([("a", 1)]), "tuple"),
    (lambda: plan_buckets([], cap_bytes=0), "cap_bytes"),
    (lambda: plan_buckets([], align_bytes=48), "power of two"),
    (lambda: plan_buckets([], order="backward"), "order"),
    (lambda: plan_buckets([("a", 1, "float32")]).locate(1), "not in this plan"),
])
def test_validation(call, match):
    with pytest.raises(ConfigError, match=match):
        call()
