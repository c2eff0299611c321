"""popmesh.compat.gfn on real worlds of 1, 2 and 3 ranks (torch or MPI engine); rank r contributes r + 1."""

import math
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.gfn as gfn
import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from worldlib import check, main, need_ranks

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
        if w.size == 1:  # a world of one runs nothing, so either name does (the default "mpi" in a plain script)
            fn(*args, backend=other)
            continue
        message = raises_config_error(fn, *args, backend=other)
        assert repr(own) in message, message
    assert raises_config_error(gfn.get_world_size, backend="nccl")


@check
def send_reinterprets_bytes_and_recv_returns_them(w):
    need_ranks(w, 2)
    own, other = names(w)
    data = torch.tensor([1.5, -2.25, 3e38], dtype=torch.float32)
    want = data.view(torch.uint8)
    if w.rank == 0:
        for dst in range(1, w.size):
            gfn.send(data, dst, backend=own, tag=3)
            gfn.send(torch.tensor([7, 300], dtype=torch.int64), dst, backend=other, tag=4)
    else:
        src, got = gfn.recv(0, backend=other, tag=3)  # the wire format does not depend on the name
        assert src == 0 and got.dtype == torch.uint8 and torch.equal(got, want), got
        assert torch.equal(got.view(torch.float32), data), "bit-identical (torchgfn value-cast floats to uint8)"
        src, got = gfn.recv(None, backend=own, tag=4)
        assert src == 0 and got.view(torch.int64).tolist() == [7, 300]


@check
def isend_handle_completes(w):
    need_ranks(w, 2)
    own, _ = names(w)
    after, before = (w.rank + 1) % w.size, (w.rank - 1) % w.size  # a ring
    handle = gfn.isend(torch.arange(5, dtype=torch.int16) * (w.rank + 1), after, backend=own, tag=5)
    src, got = gfn.recv(before, backend=own, tag=5)
    handle.wait()
    assert handle.is_complete() is True
    assert src == before and got.view(torch.int16).tolist() == [i * (before + 1) for i in range(5)]


@check
def all_reduce_in_place(w):
    own, _ = names(w)
    n = w.size
    for op, want in (("SUM", n * (n + 1) / 2), ("MAX", n), ("MIN", 1.0), ("AVG", (n + 1) / 2),
                     ("PROD", math.factorial(n))):
        t = torch.full((3,), float(w.rank + 1))
        assert gfn.all_reduce(t, op=op, backend=own) is None
        assert t.tolist() == [want] * 3, (op, t)


@check
def all_gather_into_output_list(w):
    own, _ = names(w)
    out = [torch.zeros(2, dtype=torch.float64) for _ in range(w.size)]
    gfn.all_gather(out, torch.tensor([w.rank + 1.0, -(w.rank + 1.0)], dtype=torch.float64), backend=own)
    assert [o.tolist() for o in out] == [[r + 1.0, -(r + 1.0)] for r in range(w.size)]
    assert raises_config_error(gfn.all_gather, out + out[:1], torch.zeros(2), backend=own)


@check
def broadcast_src_is_global_on_a_sub_group(w):
    need_ranks(w, 2)
    own, _ = names(w)
    sub = w.new_group([1, 0, *range(2, w.size)])  # group rank 0 is global rank 1
    t = torch.tensor([float(w.rank + 1)])
    gfn.broadcast(t, 1, backend=own, group=sub)
    assert t.item() == 2.0, "src=1 is global rank 1 (torchgfn's MPI path took group rank 1 = global 0)"


@check
def rank_and_size_of_groups(w):
    own, _ = names(w)
    assert gfn.get_rank(backend=own) == w.rank and gfn.get_world_size(backend=own) == w.size
    last = w.size - 1
    only_one = w.new_group([last])
    assert gfn.get_rank(backend=own, group=only_one) == (0 if w.rank == last else -1)
    assert gfn.get_world_size(backend=own, group=only_one) == 1
    gfn.barrier(backend=own)


@check
def gather_distributed_data_ragged_uint8(w):
    rows = 300 if w.rank == 0 else 2  # more rows than a uint8 count can hold
    data = torch.full((rows, 3), 200 + w.rank, dtype=torch.uint8)
    out = gfn.gather_distributed_data(data)
    if w.rank == 0:
        assert out.shape == (300 + 2 * (w.size - 1), 3) and out.dtype == torch.uint8
        assert out[:300].eq(200).all()
        for r in range(1, w.size):
            assert out[300 + 2 * (r - 1):300 + 2 * r].eq(200 + r).all(), r
    else:
        assert out is None
    listed = gfn.gather_distributed_data([float(w.rank + 1)] * (w.rank + 1), world_size=w.size, rank=w.rank)
    if w.rank == 0:
        assert listed.tolist() == [float(r + 1) for r in range(w.size) for _ in range(r + 1)]
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
    assert all(p.eq((w.size + 1) / 2).all() for p in model.parameters())
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
    mean = (w.size + 1) / 2
    assert model.weight.grad.tolist() == [[mean, mean]] and model.bias.grad.item() == 1.0


def members(w, group):
    """Global ranks of a context group, whatever the engine's group object."""
    if isinstance(group, (popmesh.Group, popmesh.World)):
        return tuple(group.ranks)  # the local engine has no group objects of its own
    if w.engine_name == "torch":
        import torch.distributed as dist

        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return None
        return tuple(dist.get_process_group_ranks(group))
    from mpi4py import MPI

    if group == MPI.COMM_NULL:
        return None
    return tuple(MPI.Group.Translate_ranks(group.Get_group(), list(range(group.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


@check
def contexts_have_the_documented_attributes(w):
    own, other = names(w)
    dist_backend = "gloo" if own == "torch" else "mpi"
    n, r = w.size, w.rank
    buffers = 1 if n > 1 else 0  # the last rank serves the others; a world of one only trains
    trainers = list(range(n - buffers))
    ctx = gfn.initialize_distributed_compute(dist_backend, buffers, 1)
    assert (ctx.my_rank, ctx.world_size, ctx.num_training_ranks, ctx.agent_group_size) == (r, n, n - buffers,
                                                                                           n - buffers)
    assert ctx.buffer_rank_set == set(range(n - buffers, n)) and ctx.coordinator_rank is None
    assert ctx.agent_group_id == 0 and ctx.is_coordinator_rank() is False
    assert ctx.is_training_rank() is (r in trainers) and ctx.is_buffer_rank() is (r not in trainers)
    assert ctx.assigned_buffer == (n - 1 if buffers and r in trainers else None)
    assert ctx.assigned_training_ranks == (None if r in trainers else trainers)
    mine = tuple(trainers) if r in trainers else None  # non-members hold the engine's non-member object
    assert members(w, ctx.train_global_group) == mine
    assert (members(w, ctx.buffer_group) if buffers else ctx.buffer_group) == (
        ((n - 1,) if r == n - 1 else None) if buffers else None)
    assert [members(w, g) for g in ctx.agent_groups] == [mine]
    assert ctx.get_train_group(own) is ctx.train_global_group
    if n > 1 and r in trainers:  # the seed's groups are the engine's own: its users call the engine with them
        if own == "torch":
            import torch.distributed as dist

            assert isinstance(ctx.train_global_group, dist.ProcessGroup)
            dist.barrier(group=ctx.train_global_group)  # torchgfn's training script does this five times
            total = torch.tensor([r + 1.0])
            dist.all_reduce(total, group=ctx.train_global_group)
        else:
            total = torch.tensor([float(ctx.train_global_group.allreduce(r + 1.0))])
        assert total.item() == len(trainers) * (len(trainers) + 1) / 2
        again = torch.tensor([r + 1.0])
        gfn.all_reduce(again, backend=own, group=ctx.train_global_group)  # and back into the facade
        assert again.item() == total.item()
    if n > 1:
        assert raises_config_error(ctx.get_train_group, other)
    else:  # a world of one takes either name (see above)
        assert ctx.get_train_group(other) is ctx.train_global_group
    if own == "mpi":
        assert isinstance(ctx.dc_mpi4py, gfn.DistributedContextMPI4Py)
    elif n == 1:
        assert ctx.dc_mpi4py is None  # a single-process context, as torchgfn's
    else:  # no MPI launcher started this job: asking for mpi4py communicators says how to launch
        assert "mpiexec -n" in raises_config_error(lambda: ctx.dc_mpi4py)
    ctx.cleanup()
    gfn.barrier(backend=own)  # cleanup left the world up
    if n > 1:
        assert raises_config_error(gfn.initialize_distributed_compute, "mpi" if own == "torch" else "gloo", 0, 1)


@check
def mpi4py_context(w):
    own, _ = names(w)
    n = w.size
    if n == 1:  # a world of one, on either engine: a single-process context
        ctx = gfn.initialize_distributed_compute_mpi4py(0, 1)
        assert (ctx.my_rank, ctx.world_size, ctx.num_training_ranks, ctx.coordinator_rank) == (0, 1, 1, None)
        return
    if own == "torch":
        assert "mpi" in raises_config_error(gfn.initialize_distributed_compute_mpi4py, 0, 1)
        return
    ctx = gfn.initialize_distributed_compute_mpi4py(0, 1, num_coordinators=1)
    assert isinstance(ctx, gfn.DistributedContextMPI4Py)
    assert ctx.coordinator_rank == n - 1 and ctx.num_training_ranks == n - 1 and ctx.world_size == n
    assert ctx.is_training_rank() is (w.rank < n - 1) and ctx.is_buffer_rank() is False
    from mpi4py import MPI

    assert isinstance(ctx.train_global_group, MPI.Comm)  # as the seed: an mpi4py communicator
    assert (ctx.train_global_group == MPI.COMM_NULL) is (w.rank == n - 1)
    assert raises_config_error(gfn.initialize_distributed_compute_mpi4py, 0, 1, num_coordinators=2)


class Message:
    """torchgfn's replay-buffer message (gfn.containers.message): a type and data, pickled to uint8."""

    DATA, GET_METADATA, EXIT = "DATA", "GET_METADATA", "EXIT"

    def __init__(self, message_type, message_data=None):
        self.message_type, self.message_data = message_type, message_data

    def serialize(self):
        return torch.frombuffer(bytearray(pickle.dumps(self)), dtype=torch.uint8)

    @staticmethod
    def deserialize(byte_tensor):
        return pickle.loads(bytes(byte_tensor.numpy()))


DATA_TAG, METADATA_TAG = 0, 1  # torchgfn's tags: data and scores on 0, metadata replies on 1


def run_manager(own, served):
    """torchgfn's ReplayBufferManager.run(async_send=True): score DATA, answer GET_METADATA on the
    metadata tag, stop after an EXIT from each served agent. Returns the senders in arrival order."""
    pending, senders, exits = [], [], 0
    while exits < len(served):
        sender, byte_tensor = gfn.recv(backend=own)
        msg = Message.deserialize(byte_tensor)
        pending = [h for h in pending if not h.is_complete()]
        if msg.message_type == Message.DATA:
            senders.append(sender)
            reply = Message(Message.DATA, {"score": float(msg.message_data.sum()), "sender": sender})
            pending.append(gfn.isend(reply.serialize(), dst_rank=sender, backend=own, tag=DATA_TAG))
        elif msg.message_type == Message.GET_METADATA:
            reply = Message(Message.DATA, {"served": served, "scored": len(senders)})
            pending.append(gfn.isend(reply.serialize(), dst_rank=sender, backend=own, tag=METADATA_TAG))
        else:
            exits += 1
    for handle in pending:
        handle.wait()
    return senders


def run_agent(own, manager, r):
    """torchgfn's ReplayBuffer client: a blocking DATA/score round, an async_comm round (isend now,
    the score at the next add), get_metadata (reply on the metadata tag), then the EXIT signal."""
    def score():
        _, tensor = gfn.recv(src_rank=manager, backend=own)
        return Message.deserialize(tensor).message_data

    gfn.send(Message(Message.DATA, torch.full((3,), r + 1.0)).serialize(), dst_rank=manager, backend=own)
    assert score() == {"score": 3.0 * (r + 1), "sender": r}
    handle = gfn.isend(Message(Message.DATA, torch.full((2,), r + 1.0)).serialize(), dst_rank=manager, backend=own)
    handle.wait()
    assert score() == {"score": 2.0 * (r + 1), "sender": r}
    gfn.send(Message(Message.GET_METADATA).serialize(), dst_rank=manager, backend=own)
    _, tensor = gfn.recv(manager, backend=own, tag=METADATA_TAG)
    metadata = Message.deserialize(tensor).message_data
    assert metadata["served"] == list(range(manager)) and metadata["scored"] >= 2, metadata
    gfn.send(Message(Message.EXIT).serialize(), dst_rank=manager, backend=own)


@check
def training_script_calls_and_the_replay_buffer_protocol(w):
    """What torchgfn's multinode train_hypergrid does with the context: broadcast a run name over the
    training group, barriers on it, AverageAllPolicy over it, then every agent's replay-buffer
    traffic with its manager (the last rank), EXIT signals, a final barrier and cleanup."""
    need_ranks(w, 2)
    own, _ = names(w)
    ctx = gfn.initialize_distributed_compute("gloo" if own == "torch" else "mpi", 1, 1)
    n, r, manager = w.size, w.rank, w.size - 1
    if ctx.is_buffer_rank():
        assert ctx.assigned_training_ranks == list(range(n - 1))
        assert sorted(run_manager(own, ctx.assigned_training_ranks)) == sorted(list(range(n - 1)) * 2)
    else:
        assert ctx.assigned_buffer == manager
        name = broadcast_name(w, ctx, "run-7" if r == 0 else None)
        assert name == "run-7", name
        policy = sp.AverageAllPolicy(1) if own == "torch" else sp.AverageAllPolicympi4py(1)
        group = ctx.train_global_group if own == "torch" else ctx.dc_mpi4py.train_global_group
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(r + 1.0)
        _, _, info = policy(0, model, None, group=group)
        mean = n / 2  # the mean of 1 .. n - 1 over the training ranks (torchgfn divided by the world size)
        assert info["averaged_this_iteration"] and all(p.eq(mean).all() for p in model.parameters())
        run_agent(own, manager, r)
        training_barrier(w, ctx)
    ctx.cleanup()
    ctx.cleanup()  # idempotent, and the world stays up (torchgfn finalized MPI here)
    gfn.barrier(backend=own)
    if own == "mpi":
        from mpi4py import MPI

        assert not MPI.Is_finalized()


def broadcast_name(w, ctx, name):
    """The run name from rank 0 to every training rank: its length, then its bytes (the script's wandb
    group), with the engine's own calls on the context's group."""
    group = ctx.train_global_group
    length = torch.tensor([len(name.encode()) if name else 0], dtype=torch.long)
    if w.engine_name == "torch":
        import torch.distributed as dist

        dist.broadcast(length, src=0, group=group)
        payload = torch.tensor(list(name.encode()), dtype=torch.uint8) if name else torch.empty(
            int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group)
        dist.barrier(group=group)
        return bytes(payload.tolist()).decode()
    length = group.bcast(int(length.item()), root=0)
    payload = bytearray(name.encode()) if name else bytearray(length)
    group.Bcast(payload, root=0)
    group.Barrier()
    return payload.decode()


def training_barrier(w, ctx):
    if w.engine_name == "torch":
        import torch.distributed as dist

        dist.barrier(group=ctx.train_global_group)
    else:
        ctx.dc_mpi4py.train_global_group.Barrier()


if __name__ == "__main__":
    main()
