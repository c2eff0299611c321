"""popmesh.torch.stream on one rank: element views of non-contiguous tensors, the donor's metadata, and a
world of one (where a hand-over is the identity). Real hand-overs are in tests/world/test_torch_stream.py."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

import popmesh
from popmesh.core.errors import ConfigError
from popmesh.torch import hand_over
from popmesh.torch.stream import describe_state, element_views, stream_state_


def layouts():
    """Contiguous and non-contiguous tensors of several ranks and dtypes (elements numbered in C order)."""
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    yield torch.arange(7, dtype=torch.int64)
    yield torch.tensor(3.5)
    yield torch.arange(12).reshape(3, 4).t()  # transposed
    yield torch.arange(20, dtype=torch.float64)[::3]  # strided 1-D
    yield base.permute(2, 0, 3, 1)
    yield base[:, 1:, ::2, 1:4]
    yield torch.arange(30).reshape(5, 6).to(torch.bfloat16)[:, ::2]
    yield torch.arange(6).reshape(1, 6).t().expand(6, 3).t()  # a stride-0 view


@pytest.mark.parametrize("t", list(layouts()), ids=lambda t: f"{tuple(t.shape)}{tuple(t.stride())}")
def test_element_views_cover_exactly_the_range(t):
    flat = t.reshape(-1).clone()
    n = t.numel()
    for start, stop in itertools.combinations(range(n + 1), 2):
        views = element_views(t, start, stop)
        got = torch.cat([v.reshape(-1) for v in views])
        assert torch.equal(got, flat[start:stop]), (start, stop)
        assert all(v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for v in views)  # no copies
    assert element_views(t, 2, 2) == []


def test_writing_through_element_views_changes_only_that_range():
    for t in layouts():
        if t.stride() and 0 in t.stride():
            continue  # a stride-0 view has no one place per element to write
        t = t.clone() if t.is_contiguous() else t
        before = t.reshape(-1).clone()
        start, stop = 1, max(2, t.numel() - 1)
        for v in element_views(t, start, stop):
            v.zero_()
        after = t.reshape(-1)
        assert torch.equal(after[start:stop], torch.zeros_like(after[start:stop]))
        assert torch.equal(after[:start], before[:start]) and torch.equal(after[stop:], before[stop:])


def adam_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_the_metadata_names_every_tensor_and_is_json():
    model, opt = adam_model()
    meta = describe_state(model, opt)
    names = [row[0] for row in meta["module"]]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "buffer:1.running_mean", "buffer:1.running_var",
                     "buffer:1.num_batches_tracked"]
    assert meta["module"][0] == ["0.weight", "float32", [4, 3]]
    tensors = meta["optimizer"]["tensors"]
    assert ["optimizer:0/exp_avg", "float32", [4, 3], "cpu"] in tensors
    assert ["optimizer:0/step", "float32", [], "cpu"] in tensors
    assert meta["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.9]  # tuples as lists
    assert meta["optimizer"]["params"][1] == ["float32", [4]]
    assert describe_state(None, None) == {"module": None, "optimizer": None}


def test_a_world_of_one_hands_over_to_nobody():
    with popmesh.init("local") as world:
        model, opt = adam_model()
        before = [p.clone() for p in model.parameters()]
        assert hand_over(model, opt, {"step": 3}) == {"step": 3}
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        plan = stream_state_(model, opt, donors=[0], receivers=[], group=world)
        assert plan.chunks == () and plan.transfers == ()
        with pytest.raises(ConfigError, match="chunk_bytes"):
            stream_state_(model, opt, donors=[0], receivers=[], chunk_bytes=8)
        with pytest.raises(ConfigError, match="not a member"):
            stream_state_(model, opt, donors=[1], receivers=[])
        with pytest.raises(ConfigError, match="a mapping of names to tensors"):
            describe_state([torch.zeros(2)], None)
