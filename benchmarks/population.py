"""Population policies: what they add to a training step, at the same cadence (every 10 steps unless --every).

4 ranks on torch/gloo (``--engine mpi``: on MPI), each training its own MLP (64 → 256 → 256 → 8,
~84 k float32 parameters, batch 256, Adam) for a few ms per step. Contenders, each with its own model
and optimizer, take turns, the order reversed every other round, so a noisy neighbour hits all of
them alike. A turn is a run of 3 blocks of one cadence (10 steps); its first block is not counted:
it absorbs what the previous contender's background threads left, so every counted block carries
its own contender's background work and no other's:

  none        the bare training step
  average     AverageAll(every=10): all_reduce of the parameters every 10 steps
  selective   SelectiveAveraging(every=10): all_gather of metrics, decide, one all_reduce
  async       AsyncSelectiveAveraging(every=10): snapshot + queued metric; the rest in the background
  async_report  the same policy with a rule that never replaces (threshold -1e300): only the metric
              reports and snapshots, no decision traffic; it separates what reporting costs from
              what replacing costs
  bare        a policy that is a bare function returning its inputs: the control (it costs ~nothing,
              so its distance from 1.00x is the noise of this run)

Every block starts after a barrier (not timed), so all ranks compute at once in every contender.
With more ranks than cores (4 on 2 here), the step time follows the CPU that every thread of every
rank spends, so the process CPU of a block (all threads, summed over the ranks; the median over
blocks) is reported too: it moves less with the box's noise than wall time.
Reported per contender: the world step (per block, the time until the slowest rank finished it,
since all start at a barrier; the median over blocks, divided by 10: the step time of the training
loop, and the figure the <= 5 % target is about), the median time of a 10-step block divided by 10
(the amortized step; a plain per-step median would hide the averaging step) on rank 0 and on the
slowest rank, ratios to ``none``, the time spent inside the policy call per step (mean over ranks: the main thread's own
cost, without waiting noise from other contenders), the 90th percentile of single steps on rank 0,
and the replacements applied on all ranks (a sanity check that the policies act).

``--every 100`` runs every policy at spawn_policy's default cadence (``--average_every 100``)
instead; 10 is the stress setting, a decision every ~40 ms of each rank's compute.

Run: .venv/bin/python benchmarks/population.py [--rounds N] [--ranks N] [--engine torch|mpi]
     [--every N] [--run N]   (the driver launches the world)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, write_result  # noqa: E402

WIDTH, BATCH = 256, 256
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 40
RANKS = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 4
ENGINE = sys.argv[sys.argv.index("--engine") + 1] if "--engine" in sys.argv else "torch"
EVERY = int(sys.argv[sys.argv.index("--every") + 1]) if "--every" in sys.argv else 10
RUN = int(sys.argv[sys.argv.index("--run") + 1]) if "--run" in sys.argv else 3


def build(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


class Contender:
    """One model + optimizer + policy, trained a block of steps at a time."""

    def __init__(self, name: str, policy, rank: int) -> None:
        import torch

        self.name, self.policy = name, policy
        self.model, self.opt = build(rank)
        gen = torch.Generator().manual_seed(rank)
        self.x, self.y = torch.randn(BATCH, 64, generator=gen), torch.randn(BATCH, 8, generator=gen)
        self.iteration, self.replacements = 0, 0
        self.blocks: list[float] = []
        self.cpu: list[float] = []  # process CPU (every thread) per block
        self.steps: list[float] = []
        self.in_policy = 0.0

    def step(self) -> None:
        import torch

        start = time.perf_counter()
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        if self.policy is not None:
            metric, called = -loss.item(), time.perf_counter()
            self.model, self.opt, info = self.policy(self.iteration, self.model, self.opt, metric)
            self.in_policy += time.perf_counter() - called
            self.replacements += int(info.replaced)
        self.iteration += 1
        self.steps.append(time.perf_counter() - start)

    def block(self, counted: bool = True) -> None:
        start, cpu, steps, in_policy = time.perf_counter(), time.process_time(), len(self.steps), self.in_policy
        for _ in range(EVERY):
            self.step()
        if counted:
            self.blocks.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu)
        else:  # it absorbed what the previous contender's background threads had left
            del self.steps[steps:]
            self.in_policy = in_policy


def bare_policy(iteration: int, model, optimizer, metric):
    """The control contender: a policy that does nothing, called like the others."""
    from popmesh.population import PolicyInfo

    return model, optimizer, PolicyInfo(iteration, "bare")


def worker() -> None:
    import numpy as np
    import torch

    import popmesh
    from popmesh.population import AsyncSelectiveAveraging, AverageAll, ReplacementRule, SelectiveAveraging

    torch.set_num_threads(1)
    world = popmesh.init()
    rule = ReplacementRule(ratio=0.25)
    contenders = [
        Contender("none", None, world.rank),
        Contender("average", AverageAll(every=EVERY), world.rank),
        Contender("selective", SelectiveAveraging(every=EVERY, rule=rule), world.rank),
        Contender("async", AsyncSelectiveAveraging(every=EVERY, rule=rule), world.rank),
        Contender("async_report", AsyncSelectiveAveraging(every=EVERY, rule=ReplacementRule(threshold=-1e300)),
                  world.rank),
    ]
    contenders.append(Contender("bare", bare_policy, world.rank))
    for c in contenders:  # warm-up: one block each (first collectives, thread start)
        c.block()
        c.blocks.clear()
        c.cpu.clear()
        c.steps.clear()
        c.in_policy = 0.0
    for r in range(ROUNDS):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            for b in range(RUN):
                popmesh.barrier()  # every block starts with all ranks computing (2 shared cores here)
                c.block(counted=b > 0)
    for c in contenders:
        if hasattr(c.policy, "shutdown"):
            c.policy.shutdown(timeout=60)
    replaced = popmesh.all_reduce(np.array([c.replacements for c in contenders], dtype=np.int64))
    medians = np.array([statistics.median(c.blocks) / EVERY for c in contenders])
    slowest = popmesh.all_reduce(medians, "max")
    # The world's step: every block starts at a barrier, so the block ends when its slowest rank does.
    world_blocks = popmesh.all_reduce(np.array([c.blocks for c in contenders]), "max")
    world_step = np.median(world_blocks, axis=1) / EVERY
    in_policy = popmesh.all_reduce(np.array([c.in_policy / len(c.steps) for c in contenders]), "avg")
    cpu = np.median(popmesh.all_reduce(np.array([c.cpu for c in contenders]), "sum"), axis=1)
    if world.rank == 0:
        write_result({c.name: {"block": float(m), "slowest": float(s), "world": float(wb), "replacements": int(n),
                               "in_policy": float(p), "p90": statistics.quantiles(c.steps, n=10)[-1],
                               "cpu": float(u)}
                      for c, m, s, wb, n, p, u in zip(contenders, medians, slowest, world_step, replaced, in_policy, cpu)})
    world.finalize()


def report(rows: dict) -> None:
    base, worst, world = rows["none"]["block"], rows["none"]["slowest"], rows["none"]["world"]
    cpu = rows["none"]["cpu"]
    engine = "torch/gloo" if ENGINE == "torch" else ENGINE
    print(f"\n{engine}, {RANKS} ranks, MLP 64-{WIDTH}-{WIDTH}-8 (batch {BATCH}, Adam), policy every {EVERY} "
          f"steps, {ROUNDS} rounds of {RUN}-block turns (first block not counted)")
    print(f"{'contender':12} {'world step':>11} {'/ none':>8} {'step, rank 0':>13} {'/ none':>8} {'slowest rank':>13} "
          f"{'/ none':>8} {'CPU/block':>10} {'/ none':>8} {'in policy':>10} {'p90 step r0':>12} {'replaced':>9}")
    for name, row in rows.items():
        print(f"{name:12} {row['world'] * 1e3:8.3f} ms {row['world'] / world:7.3f}x "
              f"{row['block'] * 1e3:10.3f} ms {row['block'] / base:7.3f}x {row['slowest'] * 1e3:10.3f} ms "
              f"{row['slowest'] / worst:7.3f}x {row['cpu'] * 1e3:7.1f} ms {row['cpu'] / cpu:7.3f}x "
              f"{row['in_policy'] * 1e3:7.3f} ms {row['p90'] * 1e3:9.3f} ms "
              f"{row['replacements']:9d}")


def main() -> None:
    if RUN < 2 or EVERY < 1 or ROUNDS < 1:
        sys.exit(f"--run must be >= 2 (its first block is not counted), --every and --rounds >= 1; got "
                 f"--run {RUN} --every {EVERY} --rounds {ROUNDS}")
    args = ["--worker", "--rounds", str(ROUNDS), "--run", str(RUN), "--every", str(EVERY)]
    report(launch_json(os.path.abspath(__file__), RANKS, ENGINE, *args, timeout=900))


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
