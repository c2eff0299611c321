"""The MPI engine moves host memory only: CPU tensors at every entry point that checks, and tensors
elsewhere refused before MPI sees them, on real MPI worlds.

No GPU here: the refused tensors live on torch's ``meta`` device, which takes the same check's
other branch (a CUDA tensor's own message is tested purely in tests/unit/test_device_rules.py).
After each refusal the world must still compute closed forms, which shows that no rank started a
collective with the refused buffer. Rank r contributes r + 1.
"""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import ConfigError
from popmesh.compat._windows import Exposure
from popmesh.core.ops import ReduceOp
from popmesh.population import OneSidedAveraging
from worldlib import check, main

torch.set_num_threads(1)
TIMEOUT = 60.0


def total(n):
    return n * (n + 1) // 2


@check
def cpu_tensors_at_every_entry_point(w):
    n, r, engine, group = w.size, w.rank, w.engine, w.handle
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = torch.full((4,), r + 1, dtype=dtype)
        engine.all_reduce_(x, ReduceOp.SUM, group, TIMEOUT)
        assert x.tolist() == [total(n)] * 4, (dtype, x)
        y = torch.full((3,), r + 1, dtype=dtype)
        engine.all_reduce_start(y, ReduceOp.MAX, group).wait(TIMEOUT)
        assert y.tolist() == [n] * 3, (dtype, y)
    stacked = engine.all_gather(torch.tensor([r + 1.0, -(r + 1.0)]), group, TIMEOUT)
    assert stacked.device.type == "cpu" and stacked[:, 0].tolist() == [float(i + 1) for i in range(n)]
    b = torch.full((2,), r + 1, dtype=torch.int32)
    engine.broadcast_(b, n - 1, group, TIMEOUT)
    assert b.tolist() == [n, n]
    gathered = engine.gather(torch.tensor([r + 1], dtype=torch.int64), 0, group, TIMEOUT)
    assert (gathered.reshape(-1).tolist() == list(range(1, n + 1))) if r == 0 else gathered is None
    part = engine.reduce_scatter(torch.full((2 * n,), r + 1.0), ReduceOp.SUM, group, TIMEOUT)
    assert part.device.type == "cpu" and part.tolist() == [float(total(n))] * 2


def _refused(call, what):
    try:
        call()
    except ConfigError as e:
        text = str(e)
        assert what in text and "host memory only" in text and ".cpu()" in text and "--engine torch" in text, text
    else:
        raise AssertionError(f"{what} took a tensor on the meta device")


@check
def tensors_off_the_host_refused_before_mpi(w):
    n, engine, group = w.size, w.engine, w.handle
    meta = torch.empty(2 * n, device="meta")
    _refused(lambda: engine.all_reduce_(meta, ReduceOp.SUM, group, TIMEOUT), "all_reduce")
    _refused(lambda: engine.all_reduce_start(meta, ReduceOp.SUM, group), "all_reduce_async")
    _refused(lambda: engine.all_gather(meta, group, TIMEOUT), "all_gather")
    _refused(lambda: engine.broadcast_(meta, 0, group, TIMEOUT), "broadcast")
    _refused(lambda: engine.gather(meta, 0, group, TIMEOUT), "gather")
    _refused(lambda: engine.reduce_scatter(meta, ReduceOp.SUM, group, TIMEOUT), "reduce_scatter")
    assert popmesh.all_reduce(np.array([w.rank + 1])).tolist() == [total(n)]  # every rank still in step


@check
def windows_refuse_a_model_off_the_host(w):
    model = torch.nn.Linear(3, 2, device="meta")
    policy = OneSidedAveraging(1)
    if w.size > 1:  # a world of one decides nothing, so it never exposes the model
        _refused(lambda: policy.publish(0, model, None, 1.0), "OneSidedAveraging")
        _refused(lambda: policy(1, model, None, 1.0), "OneSidedAveraging")
    _refused(lambda: Exposure(w, model, 0, 1.0), "one-sided spawn policies")
    policy.close()
    window = w.engine.snapshot_window(w.handle, 8)
    _refused(lambda: window.publish(torch.empty(8, dtype=torch.uint8, device="meta"), 1, 1.0), "publish")
    window.publish(torch.full((8,), w.rank + 1, dtype=torch.uint8), 1, 1.0)  # a CPU tensor is fine
    popmesh.barrier()
    assert window.read((w.rank + 1) % w.size, TIMEOUT).data.tolist() == [(w.rank + 1) % w.size + 1] * 8
    popmesh.barrier()
    window.free()
    assert popmesh.all_reduce(np.array([w.rank + 1])).tolist() == [total(w.size)]


if __name__ == "__main__":
    main()
