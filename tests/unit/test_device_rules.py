"""Device rules without processes: the MPI engine's refusal of tensors off the host, each rank's device
in mismatch errors, and the CPU path of the model snapshots (their CUDA path is untested on GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from popmesh.comm.agreement import describe_leaves, device_advice, device_type, shape_row, shapes_mismatch
from popmesh.comm.collectives import describe_one, device_of
from popmesh.comm.guard import signature_of
from popmesh.comm.mismatch import mismatch_error
from popmesh.core.errors import CollectiveMismatch, ConfigError
from popmesh.core.ops import ReduceOp
from popmesh.engines.local import LocalEngine
from popmesh.engines.mpi.devices import CUDA_REFUSED, require_host
from popmesh.engines.mpi.engine import MpiEngine
from popmesh.population.state.model_state import (
    from_numpy,
    layout_of,
    load_,
    optimizer_tensors,
    snapshot,
    to_numpy,
)


class CudaTensorStandIn:
    """What the check reads of a CUDA tensor: ``is_cuda`` (a tensor stand-in, not a communicator)."""

    is_cuda = True


def test_a_cuda_tensor_is_refused_with_the_way_out():
    with pytest.raises(ConfigError) as caught:
        require_host(CudaTensorStandIn(), "all_reduce")
    text = str(caught.value)
    assert text == f"all_reduce: {CUDA_REFUSED}"
    assert "not CUDA-aware" in text and ".cpu()" in text and "nccl" in text and "popmesh launch --engine torch" in text


def test_host_memory_passes_and_other_devices_are_refused():
    require_host(np.zeros(3), "broadcast")
    require_host(torch.zeros(3), "broadcast")
    require_host(torch.zeros(3, dtype=torch.bfloat16)[::2], "broadcast")
    with pytest.raises(ConfigError, match=r"gather: the MPI engine moves host memory only, and this tensor is on meta"):
        require_host(torch.empty(3, device="meta"), "gather")


def test_only_the_mpi_engine_asks_mechanisms_to_keep_models_on_the_host():
    assert MpiEngine.require_host is require_host  # what the one-sided mechanisms call, through the engine
    assert not hasattr(LocalEngine, "require_host")


def test_descriptions_name_every_device_off_the_host_and_all_when_asked():
    leaves = [torch.zeros(2, 3), torch.empty(4, device="meta"), np.zeros((), dtype=np.int64)]
    assert describe_leaves(leaves) == "float32[2,3] float32[4]@meta int64[]"
    assert describe_leaves(leaves, devices=True) == "float32[2,3]@cpu float32[4]@meta int64[]@cpu"
    assert [device_type(x) for x in leaves] == ["cpu", "meta", "cpu"]


def test_the_always_on_guard_tells_a_call_on_another_device_from_a_host_one():
    """The guard caches signatures by key: a tensor of the same dtype and shape on another device must
    key (and describe) a different call, or a rank on CUDA and one on the host would pass the guard."""
    host, other = torch.zeros(4), torch.empty(4, device="meta")
    assert describe_one(ReduceOp.SUM, host) != describe_one(ReduceOp.SUM, other)
    assert signature_of(("k", device_of(host)), lambda: describe_one(ReduceOp.SUM, host)) != \
        signature_of(("k", device_of(other)), lambda: describe_one(ReduceOp.SUM, other))
    assert device_of(np.zeros(4)) == "cpu" and device_of(host) != device_of(other)


def test_a_mismatch_lists_each_rank_s_device_and_says_what_to_do():
    per_rank = {0: "all_reduce(sum) * float32[4]@cpu", 1: "all_reduce(sum) * float32[4]@cuda:0"}
    error = mismatch_error("all_reduce", per_rank, overwritten=False)
    text = str(error)
    assert isinstance(error, CollectiveMismatch) and error.per_rank == per_rank
    assert "rank 0: all_reduce(sum) * float32[4]@cpu; rank 1: all_reduce(sum) * float32[4]@cuda:0" in text
    assert "different kinds of device (cpu, cuda)" in text
    assert ".cpu()" in text and "cuda:{local_rank}" in text and "popmesh launch --engine torch" in text
    assert text.index("different kinds of device") < text.index("The group stays usable")


def test_no_device_advice_where_ranks_agree_on_the_kind_of_device():
    assert device_advice(["float32[4]@cuda:0", "float32[4]@cuda:1"]) == ""  # one GPU per rank: the usual case
    assert device_advice(["float32[4]", "float32[5]"]) == ""
    text = str(mismatch_error("broadcast", {0: "float32[4]", 1: "float32[5]"}, overwritten=True))
    assert "different kinds of device" not in text and "rank 1: float32[5]" in text
    meta = device_advice(["float32[4]@cpu", "float32[4]@meta"])
    assert "(cpu, meta)" in meta and "nccl" not in meta


def test_shape_exchange_rows_carry_the_device_type():
    cpu, meta = shape_row(torch.zeros(2, 3), "x"), shape_row(torch.empty(2, 3, device="meta"), "x")
    assert cpu.shape == (11,) and cpu[2] == 2 and cpu[3:5].tolist() == [2, 3] and cpu[5:].tolist() == [-1] * 6
    assert cpu[0] == meta[0] and cpu[1] != meta[1] and (cpu[2:] == meta[2:]).all()
    assert (shape_row(np.zeros((2, 3), np.float32), "x") == cpu).all()  # numpy and CPU tensors agree
    error = shapes_mismatch("all_gather_ragged", {0: cpu, 3: meta}, same_leading=False)
    assert error.per_rank == {0: "float32[2,3]@cpu", 3: "float32[2,3]@meta"}
    assert "rank 3: float32[2,3]@meta" in str(error) and "(cpu, meta)" in str(error)
    same = shapes_mismatch("gather_rows", {0: cpu, 1: shape_row(torch.zeros(2, 4), "x")}, same_leading=False)
    assert same.per_rank == {0: "float32[2,3]", 1: "float32[2,4]"}  # one kind of device: not named


def test_cpu_snapshots_take_the_plain_path():
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "h": torch.tensor([1.5, -2.0],
                                                                                          dtype=torch.bfloat16)}
    flat = snapshot(tensors, layout_of(tensors))
    arrays = to_numpy(flat)
    assert arrays["float32"].tolist() == [0, 1, 2, 3, 4, 5] and arrays["bfloat16"].dtype == np.float32
    arrays["float32"][0] = 99.0  # a copy: the snapshot is untouched
    assert flat.buffers["float32"][0].item() == 0.0
    back = from_numpy(flat.layout, {"float32": arrays["float32"], "bfloat16": np.array([3.0, 4.0])})
    assert back.buffers["bfloat16"].dtype == torch.bfloat16 and back.buffers["float32"].device.type == "cpu"
    load_(tensors, back)
    assert tensors["w"].reshape(-1).tolist() == [99, 1, 2, 3, 4, 5] and tensors["h"].tolist() == [3.0, 4.0]


def test_cpu_optimizer_state_is_copied_in_order():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = optimizer_tensors(optimizer)
    assert list(state) == ["0/step", "0/exp_avg", "0/exp_avg_sq", "1/step", "1/exp_avg", "1/exp_avg_sq"]
    state["0/exp_avg"].zero_()
    assert optimizer.state[model.weight]["exp_avg"].abs().sum() > 0  # copies, not the optimizer's own
