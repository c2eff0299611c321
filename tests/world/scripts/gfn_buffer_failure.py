"""torchgfn's own replay-buffer manager and buffers (gfn.containers) on a 3-rank world through
popmesh.compat.gfn, as its multinode training script sets them up: ranks 0 and 1 train, rank 2 runs
``ReplayBufferManager.run()`` (a raw any-source ``torch.distributed.recv`` on the default group).
Each trainer sends two batches of hypergrid states, the trainers meet in a barrier, and then trainer
0 raises; trainer 1 waits for it in the next barrier. Works under mpiexec, torchrun, ``popmesh
launch`` or three processes started by hand. Prints ``READY rank=R`` once the world is formed and
``FAILING t=T`` (wall clock) just before rank 0 raises."""

import time

import torch
import torch.distributed as dist
from gfn.containers import ReplayBuffer, StatesContainer
from gfn.containers.replay_buffer_manager import ReplayBufferManager
from gfn.gym import HyperGrid

import popmesh.compat.gfn as distributed

torch.set_num_threads(1)
ctx = distributed.initialize_distributed_compute("gloo", num_remote_buffers=1, num_agent_groups=1)
env = HyperGrid(ndim=2, height=8)
print(f"READY rank={ctx.my_rank} backend={dist.get_backend()}", flush=True)
if ctx.is_buffer_rank():
    ReplayBufferManager(env, ctx.my_rank, num_training_ranks=len(ctx.assigned_training_ranks)).run()
    print(f"MANAGER DONE rank={ctx.my_rank}", flush=True)  # not reached: a trainer fails
else:
    torch.manual_seed(ctx.my_rank)
    buffer = ReplayBuffer(env, capacity=64, remote_manager_rank=ctx.assigned_buffer)
    for _ in range(2):
        states = env.reset(batch_shape=4, random=True)
        buffer.add(StatesContainer(env, states, torch.ones(4, dtype=torch.bool), env.log_reward(states)))
    dist.barrier(group=ctx.train_global_group)
    if ctx.my_rank == 0:
        print(f"FAILING t={time.time():.3f}", flush=True)
        raise ValueError("trainer 0 gives up")
    dist.barrier(group=ctx.train_global_group)  # the failed trainer never comes
    ReplayBufferManager.send_termination_signal(ctx.assigned_buffer)
