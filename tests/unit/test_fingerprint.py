"""popmesh.torch.model_fingerprint: equal for two builds of one architecture, different otherwise."""

import torch

from popmesh.torch import model_fingerprint


def _net(width: int = 8, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 1)).to(
        dtype)


def test_two_builds_of_one_architecture_share_a_fingerprint_whatever_their_values():
    torch.manual_seed(0)
    first = _net()
    torch.manual_seed(1)
    assert model_fingerprint(first) == model_fingerprint(_net())
    assert model_fingerprint(first).startswith("Sequential: 9 tensors, 66 elements, ")  # 6 parameters, 3 buffers


def test_a_shape_a_dtype_or_a_name_changes_it():
    base = model_fingerprint(_net())
    assert model_fingerprint(_net(width=9)) != base
    assert model_fingerprint(_net(dtype=torch.float64)) != base
    renamed = torch.nn.Sequential()
    for name, layer in zip(("a", "b", "c"), _net()):
        renamed.add_module(name, layer)
    assert model_fingerprint(renamed) != base
