"""popmesh.compat.gfn's context under mpiexec with the torch engine (torchgfn's ``--dist_backend gloo``
launched by mpiexec): ``initialize_distributed_compute("gloo", ...)`` forms a torch world from MPI's
ranks and hands out mpi4py communicators beside its torch groups (``dc_mpi4py``), on which the MPI
spawn policies run; torchgfn's own replay-buffer manager serves the trainers there. The last rank is
the replay-buffer rank (a world of one has none); rank r's weights are r + 1 where a closed form is
wanted, seeded random weights where bits matter."""

import importlib.util
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh.compat.gfn as gfn
import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from workers.compat_spawn_policy_worker import METRIC, builder, model_of, simulate_upstream_ages, weights
from worldlib import check, main, skip

torch.set_num_threads(1)
SIZE = int(os.environ.get("PMI_SIZE", "1"))
BUFFERS = 1 if SIZE > 1 else 0
CTX: gfn.DistributedContext  # made before the checks run: it forms the world


def mpi():
    from mpi4py import MPI

    return MPI


def mpi_members(comm):
    """Global ranks of an mpi4py communicator (None for COMM_NULL)."""
    MPI = mpi()
    if comm == MPI.COMM_NULL:
        return None
    return tuple(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group()))


def torch_members(group):
    """Global ranks of a torch process group (None where this rank is no member)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return tuple(dist.get_process_group_ranks(group))


def trainers_only():
    if not CTX.is_training_rank():
        skip("the buffer rank takes no part in the training group's policies")


@check
def the_world_runs_on_torch_and_mpi_beside_it(w):
    assert w.engine_name == "torch" and dist.get_backend() == "gloo", (w.engine_name, dist.get_backend())
    MPI = mpi()
    assert MPI.Is_initialized() and (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()) == (w.rank, w.size)
    assert isinstance(CTX.dc_mpi4py, gfn.DistributedContextMPI4Py)
    assert (CTX.dc_mpi4py.my_rank, CTX.dc_mpi4py.world_size) == (CTX.my_rank, CTX.world_size) == (w.rank, w.size)
    assert CTX.dc_mpi4py.assigned_buffer == CTX.assigned_buffer
    assert CTX.dc_mpi4py.assigned_training_ranks == CTX.assigned_training_ranks


@check
def mpi4py_communicators_have_the_torch_groups_members(w):
    side, MPI = CTX.dc_mpi4py, mpi()
    pairs = [*zip(CTX.agent_groups, side.agent_groups), (CTX.train_global_group, side.train_global_group)]
    if BUFFERS:
        pairs.append((CTX.buffer_group, side.buffer_group))
    for torch_group, comm in pairs:
        assert isinstance(comm, MPI.Comm)
        members = torch_members(torch_group)
        assert mpi_members(comm) == members, (mpi_members(comm), members)
        if members is not None:  # same size, same rank within the group
            assert (comm.Get_size(), comm.Get_rank()) == (len(members), dist.get_rank(torch_group))
    trainers = tuple(range(w.size - BUFFERS))
    assert torch_members(CTX.train_global_group) == (trainers if w.rank in trainers else None)


@check
def the_facade_takes_the_mpi4py_communicators_back(w):
    comm = CTX.dc_mpi4py.train_global_group
    assert CTX.get_train_group("mpi") is comm and CTX.get_train_group("torch") is CTX.train_global_group
    trainers = w.size - BUFFERS
    if CTX.is_training_rank():
        total = torch.tensor([w.rank + 1.0])
        gfn.all_reduce(total, backend="mpi", group=comm)  # over the torch group of the same ranks
        assert total.item() == trainers * (trainers + 1) / 2 == comm.allreduce(w.rank + 1.0)  # and mpi4py's own
        assert gfn.get_rank(backend="mpi", group=comm) == comm.Get_rank()
        assert gfn.get_world_size(backend="mpi", group=comm) == comm.Get_size() == trainers
        comm.Barrier()
    everyone = torch.tensor([w.rank + 1.0])
    gfn.all_reduce(everyone, group=mpi().COMM_WORLD)  # MPI.COMM_WORLD stands for the world
    assert everyone.item() == w.size * (w.size + 1) / 2


@check
def average_all_mpi4py_is_bit_identical_to_averaging_by_hand(w):
    """AverageAllPolicympi4py over the training group's mpi4py communicator, against torchgfn's own
    arithmetic done by hand on it: each parameter summed by MPI_Allreduce, divided by the group's size."""
    trainers_only()
    comm, MPI = CTX.dc_mpi4py.train_global_group, mpi()
    torch.manual_seed(100 + w.rank)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    by_hand = []
    for p in model.parameters():
        buf = p.detach().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        by_hand.append(buf / comm.Get_size())
    optimizer = torch.optim.AdamW(model.parameters())
    out, out_optimizer, info = sp.AverageAllPolicympi4py(1)(0, model, optimizer, group=comm)
    assert out is model and out_optimizer is optimizer and info["averaged_this_iteration"] is True
    for p, want in zip(model.parameters(), by_hand):
        got = p.detach().numpy()
        assert got.dtype == want.dtype and np.array_equal(got.view(np.int32), want.view(np.int32)), (got, want)
    gathered = comm.allgather([p.detach().numpy().copy() for p in model.parameters()])
    assert all(np.array_equal(a.view(np.int32), b.view(np.int32)) for row in gathered for a, b in zip(row, gathered[0]))


def run_one_sided(policy, calls, rank):
    """``calls`` calls without re-publishing (peers keep reading each rank's first snapshot, r + 1):
    the iterations this rank was replaced at, and the donors (global ranks) of each replacement."""
    model = model_of(rank + 1.0)
    replaced, donors = [], []
    for it in range(calls):
        model, _, info = policy(it, model, None, METRIC[rank], expose_params=False, group=policy.train_comm_group)
        if info["is_replaced"]:
            replaced.append(it)
            donors.append(list(info["policy_info"].donors))
            assert weights(model) == [sum(d + 1.0 for d in donors[-1]) / len(donors[-1])], (weights(model), donors)
    policy.train_comm_group.Barrier()
    policy.shutdown()
    return replaced, donors


@check
def one_sided_policies_decide_from_upstreams_random_draws(w):
    """Lifetimes and donors come from Python's random as torchgfn draws them, read through MPI windows
    on the mpi4py training communicator: the same decisions as torchgfn's age rule on those draws (the
    training group's global ranks are its group ranks here, so donors compare as they are)."""
    trainers_only()
    comm = CTX.dc_mpi4py.train_global_group
    n, rank = comm.Get_size(), comm.Get_rank()
    random.seed(1000 + w.rank)
    fast = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 5, age_range=(3, 3), group=comm)
    assert fast.train_comm_group is comm and fast.max_age == 3
    replaced, donors = run_one_sided(fast, 12, rank)
    assert replaced == ([3, 7, 11] if n > 1 else []), replaced
    assert all(len(d) == max(1, n // 2) and rank not in d for d in donors), donors
    random.seed(2000 + w.rank)
    general = sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, model_of(1.0), 5, age_range=(1, 3), group=comm)
    replaced, donors = run_one_sided(general, 10, rank)
    deaths, want_donors, max_age = simulate_upstream_ages(2000 + w.rank, (1, 3), 10, n, rank)
    assert (replaced, donors) == ((deaths, want_donors) if n > 1 else ([], [])), (replaced, donors, deaths)
    assert general.max_age == max_age


@check
def worst_ratio_decides_from_every_trainers_metric(w):
    trainers_only()
    comm = CTX.dc_mpi4py.train_global_group
    n, best = comm.Get_size(), comm.Get_size() - 1
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 2, replacement_ratio=0.2,
                                                        replacement_mode="worst_ratio", group=comm)
    model = model_of(w.rank + 1.0)
    model, _, info = policy(0, model, None, METRIC[w.rank], group=comm)
    assert (info["global_min_metric"], info["global_max_metric"]) == (METRIC[0], METRIC[best]), info
    assert info["is_replaced"] is (n > 1 and w.rank == 0), info  # rank 0 is the worst; donors: the others
    assert weights(model) == ([sum(d + 1.0 for d in range(1, n)) / (n - 1)] if n > 1 and w.rank == 0
                              else [w.rank + 1.0]), weights(model)
    comm.Barrier()
    policy.shutdown()


@check
def torchgfns_buffer_manager_serves_the_trainers(w):
    """torchgfn's own ReplayBufferManager (gfn.containers, from PyPI) on the buffer rank and its remote
    ReplayBuffer on the trainers, over this torch world's default group as torchgfn's script runs them:
    every batch scored (here: its number of states), then each trainer's termination signal."""
    if importlib.util.find_spec("gfn") is None:
        skip("torchgfn is not installed (make test installs it: pip install --no-deps torchgfn)")
    if not BUFFERS:
        skip("a world of one has no buffer rank")
    from gfn.containers import ReplayBuffer, StatesContainer
    from gfn.containers.replay_buffer_manager import ReplayBufferManager
    from gfn.gym import HyperGrid

    env = HyperGrid(ndim=2, height=8)
    trainers = CTX.assigned_training_ranks or []
    if CTX.is_buffer_rank():
        manager = ReplayBufferManager(env, w.rank, num_training_ranks=len(trainers),
                                      scoring_function=lambda obj: {"score": float(len(obj))}, capacity=1000)
        manager.run()  # returns once every trainer said it is done
        assert len(manager.replay_buffer) == sum(2 * (r + 1) for r in trainers for _ in range(3))
        return
    buffer = ReplayBuffer(env, capacity=100, remote_manager_rank=CTX.assigned_buffer)
    for _ in range(3):
        states = env.reset(batch_shape=2 * (w.rank + 1), random=True)
        score = buffer.add(StatesContainer(env, states, torch.ones(len(states), dtype=torch.bool),
                                           env.log_reward(states)))
        assert score == {"score": 2.0 * (w.rank + 1)}, score
    ReplayBufferManager.send_termination_signal(CTX.assigned_buffer)


@check
def the_mpi4py_context_and_cleanup(w):
    again = gfn.initialize_distributed_compute_mpi4py(BUFFERS, 1)  # on this torch world: the MPI side again
    assert isinstance(again.train_global_group, mpi().Comm)
    assert mpi_members(again.train_global_group) == mpi_members(CTX.dc_mpi4py.train_global_group)
    CTX.cleanup()
    CTX.cleanup()  # idempotent; the world and MPI stay up
    gfn.barrier(backend="torch")
    assert not mpi().Is_finalized()
    try:
        sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 1)  # the world's own side remains
    except ConfigError as e:
        raise AssertionError(f"the whole world's MPI side went with the context: {e}") from e
    gfn.barrier(backend="torch")


if __name__ == "__main__":
    CTX = gfn.initialize_distributed_compute("gloo", num_remote_buffers=BUFFERS, num_agent_groups=1)
    main(engine="torch")
