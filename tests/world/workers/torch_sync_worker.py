"""Checks of popmesh.torch on a real world; rank r contributes r + 1 so results have closed forms."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import CollectiveMismatch, ConfigError, NotInGroup
from popmesh.torch import GradientSync, broadcast_params_, mean_grads_, mean_params_
from worldlib import check, main

torch.set_num_threads(1)


def mean_of_ranks(n):
    return (n + 1) / 2


class Branchy(torch.nn.Module):
    """Three parameter sets: ``left`` on even ranks, ``right`` on odd ranks, ``never`` on none."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4)
        self.left = torch.nn.Linear(4, 2)
        self.right = torch.nn.Linear(4, 2)
        self.never = torch.nn.Linear(4, 2)

    def forward(self, x, rank):
        h = self.trunk(x)
        return (self.left if rank % 2 == 0 else self.right)(h)


def exact_grads(model, r):
    """Gradients whose sums over ranks are exact in float32 (multiples of 1/8, small)."""
    for k, p in enumerate(model.parameters()):
        ramp = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 7
        p.grad = ((ramp + k) * (r + 1) / 8).to(p.dtype)


def per_tensor_reference(model, n):
    """What OmniSafe and torchgfn do: one all-reduce per gradient, then divide by n."""
    out = []
    for p in model.parameters():
        g = p.grad.detach().clone()
        popmesh.all_reduce_(g, "sum")
        out.append(g / n)
    return out


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@check
def mean_grads_closed_form(w):
    n, r = w.size, w.rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    for p in model.parameters():
        p.grad = torch.full_like(p, r + 1.0)
    mean_grads_(model)
    for p in model.parameters():
        assert torch.allclose(p.grad, torch.full_like(p, mean_of_ranks(n))), p.grad
    first = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad.fill_(2.0 * (r + 1))
    mean_grads_(model)  # the cached sync: same views, no new buffers
    assert all(p.grad is g for p, g in zip(model.parameters(), first))
    assert all(torch.allclose(p.grad, torch.full_like(p, 2 * mean_of_ranks(n))) for p in model.parameters())


@check
def none_grads_on_some_ranks(w):
    n, r = w.size, w.rank
    for overlap, cap in ((False, None), (True, 64)):  # cap 64 B: one bucket per parameter
        model = Branchy()
        sync = GradientSync(model, cap_bytes=cap, overlap=overlap)
        x = torch.full((3, 4), r + 1.0)
        for step in range(3):  # the branch a rank takes flips every step: stale bucket slices must not leak
            model.zero_grad(set_to_none=True)
            params = dict(model.named_parameters())
            side = "left" if (r + step) % 2 == 0 else "right"
            names = [k for k in params if k.startswith(("trunk", side))]
            grads = torch.autograd.grad(model(x, r + step).sum(), [params[k] for k in names])
            local = {k: torch.zeros_like(p) for k, p in params.items()}
            local.update(zip(names, grads))
            want = {k: popmesh.all_reduce(g, "sum") / n for k, g in local.items()}  # missing = zeros
            model(x, r + step).sum().backward()
            sync()
            taken = {"trunk"} | {"left" if (i + step) % 2 == 0 else "right" for i in range(n)}
            for name, p in params.items():
                if name.split(".")[0] not in taken:
                    assert p.grad is None, f"{name}: no rank had a gradient, it must stay None"
                    continue
                assert p.grad is not None, f"{name} must be materialised with the average (overlap={overlap})"
                assert torch.allclose(p.grad, want[name]), (name, step, p.grad, want[name])


@check
def bucketed_equals_per_tensor_bitwise(w):
    n, r = w.size, w.rank
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(9, 9) for _ in range(6)])
    sync = GradientSync(model, cap_bytes=1024, overlap=False)
    assert len(sync.plan.buckets) > 2
    exact_grads(model, r)
    reference = per_tensor_reference(model, n)
    sync()
    for p, ref in zip(model.parameters(), reference):
        assert torch.equal(bits(p.grad), bits(ref)), (p.grad, ref)
    gen = torch.Generator().manual_seed(10 + r)  # arbitrary data: a + b == b + a, so exact for 2 ranks
    for p in model.parameters():
        p.grad.copy_(torch.randn(p.shape, generator=gen))
    reference = per_tensor_reference(model, n)
    sync()
    for p, ref in zip(model.parameters(), reference):
        if n <= 2:
            assert torch.equal(bits(p.grad), bits(ref))
        else:
            assert torch.allclose(p.grad, ref, rtol=1e-6, atol=1e-7)


@check
def mixed_dtypes_in_their_own_buckets(w):
    n, r = w.size, w.rank
    model = torch.nn.ModuleDict({"f32": torch.nn.Linear(4, 3), "f64": torch.nn.Linear(4, 3).double(),
                                 "bf16": torch.nn.Linear(4, 3).to(torch.bfloat16)})
    sync = GradientSync(model)
    assert {b.dtype for b in sync.plan.buckets} == {"float32", "float64", "bfloat16"}
    assert len(sync.plan.buckets) == 3
    exact_grads(model, r)
    reference = per_tensor_reference(model, n)
    sync()
    for p, ref in zip(model.parameters(), reference):
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, ref.to(p.dtype)), (p.dtype, p.grad, ref)


@check
def replan_after_adding_a_parameter(w):
    r = w.rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    sync = GradientSync(model, overlap=True)
    before = sync.plan.fingerprint()
    x = torch.full((2, 3), r + 1.0)
    model(x).sum().backward()
    sync()
    model.append(torch.nn.Linear(3, 2))  # every rank changes the model the same way
    for _ in range(2):
        model.zero_grad()
        local = torch.autograd.grad(model(x).sum(), list(model.parameters()))  # leaves .grad alone
        model(x).sum().backward()  # with overlap, .grad is in flight from here until sync()
        sync()
        assert sync.plan.fingerprint() != before and len(sync.plan.specs) == 4
        for p, g in zip(model.parameters(), local):
            assert torch.allclose(p.grad, popmesh.all_reduce(g, "avg"), rtol=1e-6)
    model[1].weight = torch.nn.Parameter(torch.zeros(4, 3))  # reshaped: 3 -> 4 outputs
    model[1].bias = torch.nn.Parameter(torch.zeros(4))
    model.zero_grad()
    model(x).sum().backward()
    sync()
    assert model[1].weight.grad.shape == (4, 3)
    assert [s.numel for s in sync.plan.specs] == [9, 3, 12, 4]


@check
def overlap_on_and_off_give_equal_grads(w):
    r = w.rank

    def build():
        torch.manual_seed(2)
        return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(5)], torch.nn.Linear(16, 1))

    models = [build(), build()]
    syncs = [GradientSync(models[0], cap_bytes=600, overlap=True), GradientSync(models[1], cap_bytes=600,
                                                                                overlap=False)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(r))
    for step in range(3):
        for m, s, o in zip(models, syncs, opts):
            o.zero_grad(set_to_none=step % 2 == 0)
            m(x).pow(2).mean().backward()
            s()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a.grad, b.grad)
        for o in opts:
            o.step()
    flat = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
    everyone = popmesh.all_gather(flat)
    assert all(torch.equal(everyone[0], row) for row in everyone), "ranks diverged"


@check
def grads_are_bucket_views_with_either_zero_grad(w):
    r = w.rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    sync = GradientSync(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in sync.buffers]
    for set_to_none in (True, False, True):
        opt.zero_grad(set_to_none=set_to_none)
        model(torch.full((2, 6), r + 1.0)).sum().backward()
        sync()
        for p in model.parameters():
            ptr = p.grad.data_ptr()
            assert any(lo <= ptr < hi for lo, hi in buffers), "param.grad must be a view of a bucket buffer"


@check
def no_sync_accumulates_and_misuse_is_reported(w):
    n, r = w.size, w.rank
    model = torch.nn.Linear(3, 1)
    sync = GradientSync(model, overlap=True)
    x = torch.full((1, 3), r + 1.0)
    with sync.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()
    sync()
    expected = 2 * mean_of_ranks(n)  # d(sum(w.x + b))/dw = x, twice
    assert torch.allclose(model.weight.grad, torch.full((1, 3), expected)) and model.bias.grad.item() == 2.0
    model.zero_grad()
    model(x).sum().backward()
    try:
        model(x).sum().backward()  # a second pass while the buckets are being reduced
    except ConfigError as e:
        assert "no_sync" in str(e)
    else:
        raise AssertionError("a second backward during a reduction must raise")
    sync()  # drains the in-flight reductions on every rank


@check
def subgroup_with_an_idle_rank(w):
    n, r = w.size, w.rank
    members = list(range(max(1, n - 1)))  # the last rank plays a buffer rank when n > 1
    g = w.new_group(members)
    if not g.is_member:
        try:
            mean_grads_(torch.nn.Linear(2, 2), group=g)
        except NotInGroup:
            return  # and calls nothing else
        raise AssertionError("a non-member must get NotInGroup")
    k = len(members)
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, r + 1.0)
    mean_grads_(model, group=g)
    assert all(torch.allclose(p.grad, torch.full_like(p, mean_of_ranks(k))) for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(r + 1.0)
    for _ in range(3):  # torchgfn divided by the world size: the weights shrank on every call
        mean_params_(model, group=g)
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, mean_of_ranks(k))), p


@check
def broadcast_params_copies_weights_and_buffers(w):
    n, r = w.size, w.rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1).double())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(r + 1.0)
    model.train()
    model[1](torch.full((5, 4), float(r)) + torch.arange(5.0)[:, None])  # rank-dependent running stats
    model[1].num_batches_tracked.fill_(10 * (r + 1))
    where = [t.data_ptr() for t in list(model.parameters()) + list(model.buffers())]
    broadcast_params_(model, src=n - 1)
    assert where == [t.data_ptr() for t in list(model.parameters()) + list(model.buffers())], "in place"
    assert all(torch.equal(p, torch.full_like(p, float(n))) for p in model.parameters())
    assert model[1].num_batches_tracked.item() == 10 * n
    stats = torch.cat([model[1].running_mean, model[1].running_var])
    assert all(torch.equal(stats, row) for row in popmesh.all_gather(stats)), "buffers must match rank src"
    broadcast_params_(model)  # default src=0
    assert all(torch.equal(p, torch.full_like(p, float(n))) for p in model.parameters())


@check
def mean_params_then_grads(w):
    n, r = w.size, w.rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2).double())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(r + 1.0)
    mean_params_(model)
    assert all(torch.allclose(p, torch.full_like(p, mean_of_ranks(n))) for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0 * (r + 1))
    mean_grads_(model)
    assert all(torch.allclose(p.grad, torch.full_like(p, 3 * mean_of_ranks(n))) for p in model.parameters())
    mean_params_(model)
    assert all(p.dtype in (torch.float32, torch.float64) for p in model.parameters())


@check
def mean_grads_of_a_tensor(w):
    n, r = w.size, w.rank
    x = torch.tensor(float(r + 1), requires_grad=True)  # OmniSafe's doc example
    (x ** 2).backward()
    mean_grads_(x)
    assert torch.allclose(x.grad, torch.tensor(2 * mean_of_ranks(n)))


@check
def check_mode_catches_different_models(w):
    if w.size == 1:
        return
    w.check_mode = True
    try:
        extra = w.rank == w.size - 1
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), *([torch.nn.Linear(3, 3)] if extra else []))
        try:
            GradientSync(model)
        except CollectiveMismatch as e:
            assert "rank 0" in str(e) and f"rank {w.size - 1}" in str(e) and "params" in str(e), str(e)
        else:
            raise AssertionError("check mode must catch ranks that sync different models")
        GradientSync(torch.nn.Linear(2, 2))  # same structure everywhere: agreed
    finally:
        w.check_mode = False


def large_model():
    """Buckets of 256 KiB and more: on MPI on one node they are reduced in the engine's shared windows."""
    torch.manual_seed(3)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])


def lends_shared_windows(w):
    """Whether this world's buckets live in shared memory (MPI, every rank on this host)."""
    handle = getattr(w.handle, "shared", None)
    return handle is not None and handle.lending


@check
def large_buckets_in_shared_memory_equal_per_tensor(w):
    n, r = w.size, w.rank
    model = large_model()
    sync = GradientSync(model, cap_bytes=256 << 10, overlap=True)
    assert len(sync.plan.buckets) >= 3
    if w.engine_name == "mpi" and n > 1:
        assert lends_shared_windows(w), "an MPI world on one host reduces GradientSync's buckets in place"
    for step in range(3):
        exact_grads(model, r + step)
        reference = per_tensor_reference(model, n)
        model.zero_grad(set_to_none=step % 2 == 0)
        exact_grads(model, r + step)
        sync()
        for p, ref in zip(model.parameters(), reference):
            assert torch.equal(bits(p.grad), bits(ref)), (step, p.grad.flatten()[:4], ref.flatten()[:4])
    # after lending, large arrays elsewhere still reduce right (not in a window: MPI's own path),
    # blocking and started, with waits out of order beside a small blocking call
    big = torch.full((70_000,), float(r + 1))
    other = torch.full((50_000,), float(2 * r))
    first = popmesh.all_reduce_async_(big)
    second = popmesh.all_reduce_async_(other, op="max")
    small = popmesh.all_reduce(torch.tensor([r + 1.0]))
    second.wait()
    first.wait()
    assert torch.equal(big, torch.full_like(big, n * (n + 1) / 2)) and small.item() == n * (n + 1) / 2
    assert torch.equal(other, torch.full_like(other, 2.0 * (n - 1)))
    exact_grads(model, r)
    reference = per_tensor_reference(model, n)
    sync()
    for p, ref in zip(model.parameters(), reference):
        assert torch.equal(bits(p.grad), bits(ref))


@check
def sync_against_another_collective_is_a_mismatch(w):
    """A repeated (predicted) sync on most ranks against another call on one: CollectiveMismatch on
    every rank, and the group goes on working (also where the bucket lives in shared memory). One
    bucket: a mismatch found while later buckets are in flight leaves the group unusable."""
    if w.size == 1:
        return
    model = large_model()
    sync = GradientSync(model, cap_bytes=4 << 20, overlap=False)
    assert len(sync.plan.buckets) == 1
    for _ in range(3):
        exact_grads(model, w.rank)
        sync()
    exact_grads(model, w.rank)
    try:
        if w.rank == w.size - 1:
            popmesh.all_reduce(torch.zeros(5))
        else:
            sync()
    except CollectiveMismatch as e:
        assert f"rank {w.size - 1}" in str(e), str(e)
    else:
        raise AssertionError("a sync against another collective must raise CollectiveMismatch")
    assert popmesh.all_reduce(torch.tensor([1.0])).item() == w.size
    exact_grads(model, w.rank)
    reference = per_tensor_reference(model, w.size)
    sync()
    for p, ref in zip(model.parameters(), reference):
        assert torch.equal(bits(p.grad), bits(ref))


if __name__ == "__main__":
    main()
