"""OmniSafe's own distributed test (tests/distribution_train.py trains NaturalPG with parallel=2) through
the facade: ``fork(2)`` relaunches ``python -m omnisafe_fork`` on two ranks, each of which runs the
helpers an on-policy training step uses; the parent prints once every rank succeeded."""

import sys

import torch

import popmesh.compat.omnisafe as distributed

if distributed.fork(2):
    print("PARENT done", flush=True)
    sys.exit(0)

rank, size = distributed.get_rank(), distributed.world_size()
torch.manual_seed(rank)
torch.set_num_threads(1)
model = torch.nn.Linear(3, 2)
distributed.sync_params(model)  # after building the actor-critic
same = [torch.equal(distributed.dist_max(p.data), distributed.dist_min(p.data)) for p in model.parameters()]
assert all(same), "sync_params left the ranks' parameters different"
model(torch.full((4, 3), rank + 1.0)).pow(2).sum().backward()
distributed.avg_grads(model)  # after every backward
same = [torch.equal(distributed.dist_max(p.grad), distributed.dist_min(p.grad)) for p in model.parameters()]
assert all(same), "avg_grads left the ranks' gradients different"
fvp = torch.tensor([rank + 1.0, -(rank + 1.0)])
distributed.avg_tensor(fvp)  # NaturalPG's Fisher-vector product
assert fvp.tolist() == [1.5, -1.5], fvp
advantages = torch.arange(rank + 2, dtype=torch.float32)  # 0, 1 on rank 0; 0, 1, 2 on rank 1
mean, std, low, high = distributed.dist_statistics_scalar(advantages, with_min_and_max=True)
assert (low.item(), high.item()) == (0.0, 2.0), (low, high)
assert abs(mean.item() - 0.8) < 1e-6 and abs(std.item() - 0.56 ** 0.5) < 1e-6, (mean, std)
loss = torch.tensor(rank + 1.0, dtype=torch.float32 if rank == 0 else torch.float64)  # logged loss, mixed dtypes
assert distributed.dist_avg(loss).item() == 1.5 and distributed.is_master() is (rank == 0)
print(f"CHILD rank={rank} size={size} ok", flush=True)
