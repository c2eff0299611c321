"""The README's example: averaging gradients across ranks. Run: popmesh launch -n 4 examples/average_gradients.py"""

import torch

import popmesh
from popmesh.torch import GradientSync

world = popmesh.init()  # torch/gloo here; mpiexec → MPI; plain python → one rank
torch.manual_seed(world.rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
popmesh.torch.broadcast_params_(model, src=0)  # everyone starts from rank 0's weights
sync = GradientSync(model)  # bucketed, overlaps with backward, grads are views
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(100):
    x = torch.randn(32, 8)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    sync()  # gradients now averaged over the world
    opt.step()
print(world.rank, popmesh.all_reduce(loss.item(), "avg"))
