"""Models and helpers shared by the population world workers: every tensor of rank r holds r + 1."""

import math

import numpy as np
import torch
from torch import nn


class Agent(nn.Module):
    """Mixed dtypes on purpose: float32 linear layer, a float64 and a float16 parameter, BatchNorm buffers."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.small = nn.Parameter(torch.zeros(5, dtype=torch.float16))
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.linear(x)) * self.scale.float().sum() + self.small.float().sum()


def make_agent(value):
    """An Agent whose parameters and floating buffers all equal ``value``."""
    agent = Agent()
    fill(agent, value)
    return agent


def fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
        for b in model.buffers():
            if b.is_floating_point():
                b.fill_(value)


def values(model):
    """Every parameter as one float64 numpy vector."""
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def assert_all(model, expected, tol=1e-6, what=""):
    """Every parameter equals ``expected`` up to ``tol`` (float16 parameters: up to their precision)."""
    for name, p in model.named_parameters():
        t = max(tol, 2e-3) if p.dtype == torch.float16 else tol
        v = p.detach().double().reshape(-1).numpy()
        assert np.allclose(v, expected, rtol=t, atol=t), f"{what}: {name} expected {expected}, got {np.unique(v)}"


def buffers_value(model):
    return model.norm.running_mean.double().numpy()


def adam_for(model, lr=0.01, steps=1, grad=None):
    """An Adam optimizer that has taken ``steps`` steps with gradient ``grad`` on every parameter."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    snapshot = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0 if grad is None else grad)
        opt.step()
    with torch.no_grad():  # keep the closed-form weights; only the optimizer state should differ
        for p, s in zip(model.parameters(), snapshot):
            p.copy_(s)
    return opt


def exp_avg_of(opt):
    """The first parameter's Adam first moment (a scalar: every element is equal here)."""
    state = opt.state_dict()["state"]
    if not state:
        return None
    return float(state[0]["exp_avg"].reshape(-1)[0])


def mean(xs):
    return sum(xs) / len(xs)


def close(a, b, tol=1e-6):
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
