"""popmesh.compat.omnisafe on real worlds: the seed document's examples (written for 2 ranks), on 1, 2 and
3 ranks; rank r holds r + 1, so with n ranks the mean is (n + 1) / 2."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.omnisafe as omnisafe
from worldlib import check, main

torch.set_num_threads(1)
RANK_BEFORE_INIT = omnisafe.get_rank()  # the facade initialises the launched world itself


def value(w):
    return float(w.rank + 1)  # 1.0 on process 0, 2.0 on process 1: the document's numbers


def mean(w):
    return (w.size + 1) / 2  # 1.5 on the document's two processes


def total(w):
    return w.size * (w.size + 1) / 2


@check
def rank_and_size_inside_a_launched_world(w):
    assert RANK_BEFORE_INIT == w.rank == omnisafe.get_rank()
    assert omnisafe.world_size() == w.size
    assert omnisafe.is_master() is (w.rank == 0)
    assert omnisafe.fork(w.size) is False  # inside the ranks fork only says "already forked"
    assert omnisafe.fork(w.size, manual_args=["train.py"]) is False


@check
def avg_tensor_example(w):
    x = torch.tensor(value(w))
    assert omnisafe.avg_tensor(x) is None
    assert torch.equal(x, torch.tensor(mean(w))), x


@check
def avg_grads_example(w):
    x = torch.tensor(value(w), requires_grad=True)
    y = x ** 2
    y.backward()
    assert torch.equal(x.grad, torch.tensor(2.0 * value(w)))
    assert omnisafe.avg_grads(x) is None
    assert torch.equal(x.grad, torch.tensor(2.0 * mean(w))), x.grad


def linear(w):
    torch.manual_seed(w.rank)
    model = torch.nn.Linear(1, 1)
    model.weight.data = torch.tensor([[value(w)]])
    return model


@check
def sync_params_example(w):
    model = linear(w)
    assert omnisafe.sync_params(model) is None
    assert torch.equal(model.weight.data, torch.tensor([[1.0]])), model.weight
    zero = linear(w) if w.rank == 0 else None
    if zero is not None:
        assert torch.equal(model.bias.data, zero.bias.data)  # every parameter is rank 0's


@check
def avg_params_example(w):
    model = linear(w)
    assert omnisafe.avg_params(model) is None
    assert torch.equal(model.weight.data, torch.tensor([[mean(w)]])), model.weight


@check
def dist_examples(w):
    x = torch.tensor(value(w))
    assert torch.equal(omnisafe.dist_avg(x), torch.tensor(mean(w)))
    assert torch.equal(omnisafe.dist_sum(x), torch.tensor(total(w)))
    assert torch.equal(omnisafe.dist_max(x), torch.tensor(float(w.size)))
    assert torch.equal(omnisafe.dist_min(x), torch.tensor(1.0))
    assert x.item() == value(w), "the caller's tensor is not overwritten (OmniSafe's dist_op aliased it)"


@check
def dist_op_takes_torch_reduce_ops(w):
    x = torch.tensor([value(w), -value(w)], dtype=torch.float64)
    ops = torch.distributed.ReduceOp
    n = float(w.size)
    assert omnisafe.dist_op(x, ops.SUM).tolist() == [total(w), -total(w)]
    assert omnisafe.dist_op(x, ops.MAX).tolist() == [n, -1.0]
    assert omnisafe.dist_op(x, ops.MIN).tolist() == [1.0, -n]
    assert omnisafe.dist_op(x, "avg").dtype == torch.float64, "dtype kept (OmniSafe cast to float32)"


@check
def dist_statistics_scalar_example(w):
    avg, std = omnisafe.dist_statistics_scalar(torch.tensor(value(w)).reshape(1))
    assert avg.item() == mean(w), avg  # the population std of 1..n: sqrt((n^2 - 1) / 12), 0.5 for two
    assert abs(std.item() - ((w.size ** 2 - 1) / 12) ** 0.5) < 1e-6, std


@check
def dist_statistics_scalar_min_max_are_global_scalars(w):
    data = torch.tensor([1.0, 5.0, 3.0]) if w.rank == 0 else torch.tensor([-(w.rank + 1.0)])  # different lengths
    avg, std, low, high = omnisafe.dist_statistics_scalar(data, with_min_and_max=True)
    everything = torch.tensor([1.0, 5.0, 3.0] + [-(r + 1.0) for r in range(1, w.size)])
    assert abs(avg.item() - everything.mean().item()) < 1e-6, (avg, everything)  # 1.75 on two processes
    assert (low.item(), high.item()) == (everything.min().item(), 5.0), (low, high)
    assert abs(std.item() - everything.std(unbiased=False).item()) < 1e-6


@check
def setup_distributed_shares_cores(w):
    assert omnisafe.setup_distributed() is None
    assert torch.get_num_threads() >= 1


@check
def mixed_dtypes_reduce_as_omnisafe(w):
    """float32 on even ranks, float64 on odd ones (and a Python float beside a tensor): OmniSafe
    converted every value to float32 before reducing, so such code worked; the facade gives the same
    result, while popmesh's own dtype-keeping reduction raises CollectiveMismatch on every rank."""
    mine = torch.float32 if w.rank % 2 == 0 else torch.float64
    mixed = w.size > 1
    x = torch.tensor([value(w) + 2.0 ** -30, 0.5], dtype=mine)  # float32 drops the 2**-30
    if mixed:
        try:
            popmesh.all_reduce(x, "sum")
        except popmesh.CollectiveMismatch as e:
            assert "float64" in str(e) and "float32" in str(e), e
        else:
            raise AssertionError("popmesh.all_reduce accepted float32 beside float64")
    got = omnisafe.dist_sum(x)
    want = [total(w), 0.5 * w.size] if mixed else x.tolist()
    assert got.dtype == (torch.float32 if mixed else mine) and got.tolist() == want, (got, want)
    assert x.dtype == mine and x[0].item() == value(w) + (2.0 ** -30 if mine == torch.float64 else 0.0)
    assert omnisafe.dist_max(x).tolist() == [float(w.size) if mixed else x[0].item(), 0.5]
    scalar = value(w) if w.rank % 2 == 0 else torch.tensor([value(w)])  # OmniSafe wrapped a scalar as [x]
    got = omnisafe.dist_avg(scalar)
    got = got.tolist() if hasattr(got, "tolist") else got  # a Python float in a world of one, as given
    assert got == (mean(w) if w.rank % 2 == 0 else [mean(w)]), got
    t = torch.tensor([value(w)], dtype=mine)
    omnisafe.avg_tensor(t)
    assert t.dtype == mine and t.tolist() == [mean(w)], t
    p = torch.tensor(value(w), dtype=mine, requires_grad=True)
    (p ** 2).backward()
    omnisafe.avg_grads(p)
    assert p.grad.dtype == mine and p.grad.item() == 2.0 * mean(w), p.grad
    model = linear(w).to(mine)
    omnisafe.avg_params(model)
    assert model.weight.dtype == mine and model.weight.item() == mean(w), model.weight
    assert omnisafe.dist_sum(torch.tensor([1.0], dtype=mine)).item() == w.size  # the group is still in step


if __name__ == "__main__":
    main()
