"""popmesh.compat.gfn on a real 2-rank world (torch or MPI engine); rank r contributes r + 1."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh.compat.gfn as gfn
from popmesh import ConfigError
from worldlib import check, main

torch.set_num_threads(1)


def names(w):
    """The backend name of this world's engine, and the other one."""
    own = "torch" if w.engine_name == "torch" else "mpi"
    return own, "mpi" if own == "torch" else "torch"


def raises_config_error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise ConfigError")


@check
def module_attributes(w):
    assert gfn.default_backend == "mpi" and gfn.logger.name == "popmesh.compat.gfn"
    assert isinstance(w, gfn.Group)


@check
def a_backend_other_than_the_engine_is_a_config_error(w):
    own, other = names(w)
    t = torch.ones(2)
    for fn, args in ((gfn.all_reduce, (t,)), (gfn.broadcast, (t, 0)), (gfn.barrier, ()), (gfn.get_rank, ())):
        message = raises_config_error(fn, *args, backend=other)
        assert repr(own) in message, message
    assert raises_config_error(gfn.get_world_size, backend="nccl")


@check
def send_reinterprets_bytes_and_recv_returns_them(w):
    own, other = names(w)
    data = torch.tensor([1.5, -2.25, 3e38], dtype=torch.float32)
    want = data.view(torch.uint8)
    if w.rank == 0:
        gfn.send(data, 1, backend=own, tag=3)
        gfn.send(torch.tensor([7, 300], dtype=torch.int64), 1, backend=other, tag=4)
    else:
        src, got = gfn.recv(0, backend=other, tag=3)  # the wire format does not depend on the name
        assert src == 0 and got.dtype == torch.uint8 and torch.equal(got, want), got
        assert torch.equal(got.view(torch.float32), data), "bit-identical (torchgfn value-cast floats to uint8)"
        src, got = gfn.recv(None, backend=own, tag=4)
        assert src == 0 and got.view(torch.int64).tolist() == [7, 300]


@check
def isend_handle_completes(w):
    own, _ = names(w)
    peer = 1 - w.rank
    handle = gfn.isend(torch.arange(5, dtype=torch.int16) * (w.rank + 1), peer, backend=own, tag=5)
    src, got = gfn.recv(peer, backend=own, tag=5)
    handle.wait()
    assert handle.is_complete() is True
    assert src == peer and got.view(torch.int16).tolist() == [i * (peer + 1) for i in range(5)]


@check
def all_reduce_in_place(w):
    own, _ = names(w)
    for op, want in (("SUM", 3.0), ("MAX", 2.0), ("MIN", 1.0), ("AVG", 1.5), ("PROD", 2.0)):
        t = torch.full((3,), float(w.rank + 1))
        assert gfn.all_reduce(t, op=op, backend=own) is None
        assert t.tolist() == [want] * 3, (op, t)


@check
def all_gather_into_output_list(w):
    own, _ = names(w)
    out = [torch.zeros(2, dtype=torch.float64) for _ in range(w.size)]
    gfn.all_gather(out, torch.tensor([w.rank + 1.0, -(w.rank + 1.0)], dtype=torch.float64), backend=own)
    assert [o.tolist() for o in out] == [[1.0, -1.0], [2.0, -2.0]]
    assert raises_config_error(gfn.all_gather, out[:1], torch.zeros(2), backend=own)


@check
def broadcast_src_is_global_on_a_sub_group(w):
    own, _ = names(w)
    sub = w.new_group([1, 0])  # group rank 0 is global rank 1
    t = torch.tensor([float(w.rank + 1)])
    gfn.broadcast(t, 1, backend=own, group=sub)
    assert t.item() == 2.0, "src=1 is global rank 1 (torchgfn's MPI path took group rank 1 = global 0)"


@check
def rank_and_size_of_groups(w):
    own, _ = names(w)
    assert gfn.get_rank(backend=own) == w.rank and gfn.get_world_size(backend=own) == 2
    only_one = w.new_group([1])
    assert gfn.get_rank(backend=own, group=only_one) == (0 if w.rank == 1 else -1)
    assert gfn.get_world_size(backend=own, group=only_one) == 1
    gfn.barrier(backend=own)


@check
def gather_distributed_data_ragged_uint8(w):
    rows = 300 if w.rank == 0 else 2  # more rows than a uint8 count can hold
    data = torch.full((rows, 3), 200 + w.rank, dtype=torch.uint8)
    out = gfn.gather_distributed_data(data)
    if w.rank == 0:
        assert out.shape == (302, 3) and out.dtype == torch.uint8
        assert out[:300].eq(200).all() and out[300:].eq(201).all()
    else:
        assert out is None
    listed = gfn.gather_distributed_data([float(w.rank + 1)] * (w.rank + 1), world_size=2, rank=w.rank)
    if w.rank == 0:
        assert listed.tolist() == [1.0, 2.0, 2.0]
    assert raises_config_error(gfn.gather_distributed_data, data, world_size=5)


def model_of(value):
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


@check
def average_models_divides_by_the_group_size(w):
    model = model_of(w.rank + 1.0)
    gfn.average_models(model)
    assert all(p.eq(1.5).all() for p in model.parameters())
    alone = w.new_group([0])
    model = model_of(w.rank + 1.0)
    if w.rank == 0:
        gfn.average_models(model, training_group=alone)
        assert all(p.eq(1.0).all() for p in model.parameters()), "torchgfn divided by the world size: 0.5"


@check
def average_gradients_over_the_world(w):
    model = model_of(1.0)
    model(torch.full((1, 2), float(w.rank + 1))).sum().backward()
    gfn.average_gradients(model)
    assert model.weight.grad.tolist() == [[1.5, 1.5]] and model.bias.grad.item() == 1.0


@check
def contexts_have_the_documented_attributes(w):
    own, other = names(w)
    dist_backend = "gloo" if own == "torch" else "mpi"
    ctx = gfn.initialize_distributed_compute(dist_backend, 1, 1)
    assert (ctx.my_rank, ctx.world_size, ctx.num_training_ranks, ctx.agent_group_size) == (w.rank, 2, 1, 1)
    assert ctx.buffer_rank_set == {1} and ctx.coordinator_rank is None and ctx.agent_group_id == 0
    assert ctx.is_training_rank() is (w.rank == 0) and ctx.is_buffer_rank() is (w.rank == 1)
    assert ctx.is_coordinator_rank() is False
    assert ctx.assigned_buffer == (1 if w.rank == 0 else None)
    assert ctx.assigned_training_ranks == (None if w.rank == 0 else [0])
    assert ctx.train_global_group.ranks == (0,) and ctx.buffer_group.ranks == (1,)
    assert [g.ranks for g in ctx.agent_groups] == [(0,)]
    assert ctx.get_train_group(own) is ctx.train_global_group
    assert raises_config_error(ctx.get_train_group, other)
    assert (ctx.dc_mpi4py is not None) is (own == "mpi")
    ctx.cleanup()
    gfn.barrier(backend=own)  # cleanup left the world up
    assert raises_config_error(gfn.initialize_distributed_compute, "mpi" if own == "torch" else "gloo", 0, 1)


@check
def mpi4py_context(w):
    own, _ = names(w)
    if own == "torch":
        assert "mpi" in raises_config_error(gfn.initialize_distributed_compute_mpi4py, 0, 1)
        return
    ctx = gfn.initialize_distributed_compute_mpi4py(0, 1, num_coordinators=1)
    assert isinstance(ctx, gfn.DistributedContextMPI4Py)
    assert ctx.coordinator_rank == 1 and ctx.num_training_ranks == 1 and ctx.world_size == 2
    assert ctx.is_training_rank() is (w.rank == 0) and ctx.is_buffer_rank() is False
    assert raises_config_error(gfn.initialize_distributed_compute_mpi4py, 0, 1, num_coordinators=2)


if __name__ == "__main__":
    main()
