"""Population policies: what they add to a training step, all at the same cadence (--every, default 100).

4 ranks on torch/gloo (``--engine mpi``: on MPI), each training its own MLP (64 → 256 → 256 → 8,
~84 k float32 parameters, batch 256, Adam) for a few ms per step. The default cadence, 100 steps,
is spawn_policy's (its driver ships ``--average_every 100``); ``--every 10`` is the stress setting,
a decision every ~40 ms of each rank's compute. Contenders, each with its own model and optimizer,
take turns, the order reversed every other round, so a noisy neighbour hits all of them alike. A
turn is a run of 3 blocks of one cadence; its first block is not counted: it absorbs what the
previous contender's background threads left, so every counted block carries its own contender's
background work and no other's:

  none        the bare training step
  average     AverageAll(every): all_reduce of the parameters at every cadence
  selective   SelectiveAveraging(every): all_gather of metrics, decide, one all_reduce
  async       AsyncSelectiveAveraging(every): snapshot + queued metric; the rest in the background
  async_report  the same policy with a rule that never replaces (threshold -1e300): only the metric
              reports and snapshots, no decision traffic; it separates what reporting costs from
              what replacing costs
  raw_streams the raw engine moving the weights of one replacement per cadence (with 4 ranks: 3 donors'
              streams of 336 KB, averaged in a background thread and copied in), with no metrics,
              decisions or wire format: the floor for any asynchronous policy that moves these bytes
  bare        a policy that is a bare function returning its inputs: the control (it costs ~nothing,
              so its distance from 1.00x is the noise of this run)

Every block starts after a barrier (not timed), so all ranks compute at once in every contender.
With more ranks than cores (4 on 2 here), the step time follows the CPU that every thread of every
rank spends, so the process CPU of a block (all threads, summed over the ranks) is reported too.
Reported per contender: the world step (per block, the time until the slowest rank finished it,
since all start at a barrier, divided by the cadence: the step time of the training loop, the
figure the <= 5 % target is about), the amortized step on rank 0 and on the slowest rank (a plain
per-step median would hide the averaging step), the CPU of a block, the time spent inside the
policy call per step (mean over ranks: the main thread's own cost), the 90th percentile of single
steps on rank 0, and the replacements applied on all ranks (a sanity check that the policies act).
The first table gives medians over all counted blocks and their ratios to ``none``. The second
pairs each contender's turn with ``none``'s turn in the same round and gives the median of those
per-round ratios with a 95 % confidence interval: the box drifts by several per cent over a run,
and a ratio of neighbouring turns cancels most of that.

Run: .venv/bin/python benchmarks/population.py [--every N] [--rounds N] [--ranks N]
     [--engine torch|mpi] [--run N] [--only none,async,...]   (the driver launches the world)
     --rounds defaults to 2000 / every (at least 10): about 4-5 minutes of turns either way;
     --only runs a subset of the contenders (it must include none).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, threads_line, world_threads, write_result

WIDTH, BATCH = 256, 256
RANKS = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 4
ENGINE = sys.argv[sys.argv.index("--engine") + 1] if "--engine" in sys.argv else "torch"
EVERY = int(sys.argv[sys.argv.index("--every") + 1]) if "--every" in sys.argv else 100
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else max(10, 2000 // max(EVERY, 1))
# the driver hands --run to its ranks as --run-blocks: `popmesh launch` would take --run for its --run-path
_RUN = "--run-blocks" if "--worker" in sys.argv else "--run"
RUN = int(sys.argv[sys.argv.index(_RUN) + 1]) if _RUN in sys.argv else 3
ALL = ("none", "average", "selective", "async", "async_report", "raw_streams", "bare")
ONLY = tuple(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else ALL


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


class RawStreams:
    """The weight traffic of one replacement per cadence over the raw engine, and nothing else.

    At every cadence the replaced rank rotates; the other ranks' main threads copy their weights
    into one flat tensor and start a raw send of it (``dist.isend`` on a group of its own, or
    mpi4py ``Isend`` on a duplicated communicator). The replaced rank's background thread receives
    them into reused buffers (gloo: a blocking receive; MPI: ``Test`` every millisecond) and
    averages them; its main thread copies the mean in at its next call. No metrics, no decision,
    no wire format: a floor for any asynchronous policy that moves the same bytes.
    """

    def __init__(self, engine: str, rank: int, size: int, decisions: int) -> None:
        import threading

        import torch

        self.rank, self.size, self.decision = rank, size, 0
        self._sends: list = []
        self._pending = None
        self._lock = threading.Lock()
        if engine == "mpi":
            from mpi4py import MPI

            self._comm, self._group = MPI.COMM_WORLD.Dup(), None
        else:
            import torch.distributed as dist

            self._comm, self._group = None, dist.new_group(list(range(size)))
        numel = sum(p.numel() for p in build(0)[0].parameters())
        self._bufs = [torch.empty(numel) for _ in range(size)]
        self._thread = threading.Thread(target=self._receive, args=(decisions,), daemon=True)
        self._thread.start()

    def __call__(self, iteration: int, model, optimizer, metric):
        import torch

        from popmesh.population import PolicyInfo

        info = PolicyInfo(iteration, "raw_streams")
        if self._pending is not None:
            with self._lock:
                mean, self._pending = self._pending, None
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(mean, model.parameters())
            info.replaced = True
        if iteration % EVERY == 0:
            self._complete_sends()
            replaced, self.decision = self.decision % self.size, self.decision + 1
            if self.rank != replaced:
                with torch.no_grad():
                    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
                self._sends = [self._send(flat, replaced)]
        return model, optimizer, info

    def _send(self, flat, dst: int):
        if self._comm is not None:
            self._keep = flat
            return self._comm.Isend(flat.numpy(), dst)
        import torch.distributed as dist

        return dist.isend(flat, dst, group=self._group)

    def _receive(self, decisions: int) -> None:
        import torch.distributed as dist

        for d in range(decisions):
            if d % self.size != self.rank:
                continue
            donors = [r for r in range(self.size) if r != self.rank]
            for src in donors:
                if self._comm is None:
                    dist.recv(self._bufs[src], src, group=self._group)
                else:
                    request = self._comm.Irecv(self._bufs[src].numpy(), src)
                    while not request.Test():
                        time.sleep(1e-3)
            mean = self._bufs[donors[0]].clone()
            for src in donors[1:]:
                mean += self._bufs[src]
            mean /= len(donors)
            with self._lock:
                self._pending = mean

    def _complete_sends(self) -> None:
        """Wait for this rank's sends, once each (a second wait on a completed gloo send hangs)."""
        for request in self._sends:
            request.Wait() if self._comm is not None else request.wait()
        self._sends = []

    def shutdown(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._complete_sends()
        if self._thread.is_alive():
            raise RuntimeError(f"raw_streams: the receiving thread still runs after {timeout} s")


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
    policies = {
        "none": lambda: None,
        "average": lambda: AverageAll(every=EVERY),
        "selective": lambda: SelectiveAveraging(every=EVERY, rule=rule),
        "async": lambda: AsyncSelectiveAveraging(every=EVERY, rule=rule),
        "async_report": lambda: AsyncSelectiveAveraging(every=EVERY, rule=ReplacementRule(threshold=-1e300)),
        "raw_streams": lambda: RawStreams(world.engine_name, world.rank, world.size, 1 + ROUNDS * RUN),
        "bare": lambda: bare_policy,
    }
    contenders = [Contender(name, policies[name](), world.rank) for name in ALL if name in ONLY]
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
    threads = world_threads()  # before shutdown: every policy's background thread still alive
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
    cpu_blocks = popmesh.all_reduce(np.array([c.cpu for c in contenders]), "sum")
    cpu = np.median(cpu_blocks, axis=1)
    if world.rank == 0:
        write_result({c.name: {"block": float(m), "slowest": float(s), "world": float(wb), "replacements": int(n),
                               "in_policy": float(p), "p90": statistics.quantiles(c.steps, n=10)[-1],
                               "cpu": float(u), "world_blocks": wbs.tolist(), "cpu_blocks": ubs.tolist()}
                      for c, m, s, wb, n, p, u, wbs, ubs in zip(contenders, medians, slowest, world_step, replaced,
                                                                in_policy, cpu, world_blocks, cpu_blocks)}
                     | {"threads": threads})
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


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free ``level`` confidence interval for it: the
    order statistics whose ranks a Binomial(n, 1/2) count brackets with that probability."""
    xs, n = sorted(values), len(values)
    tail, j = 0.0, 0
    while j < n // 2 and tail + math.comb(n, j) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, j) / 2 ** n
        j += 1
    return statistics.median(xs), xs[max(j - 1, 0)], xs[min(n - j, n - 1)]


def paired_ratios(blocks: list[float], base: list[float]) -> list[float]:
    """Per round, a contender's mean counted block over ``none``'s in the same round: adjacent turns,
    so drift of the box over a run (seconds to minutes) cancels out of each ratio."""
    per = RUN - 1
    return [sum(blocks[i:i + per]) / sum(base[i:i + per]) for i in range(0, len(base), per)]


def report_paired(rows: dict) -> None:
    print(f"\npaired per round (each ratio against none's turn in the same round; median [95 % CI] over "
          f"{ROUNDS} rounds)")
    print(f"{'contender':12} {'world step / none':>28} {'CPU / none':>28}")
    for name, row in rows.items():
        if name == "none":
            continue
        cells = []
        for key in ("world_blocks", "cpu_blocks"):
            mid, low, high = median_interval(paired_ratios(row[key], rows["none"][key]))
            cells.append(f"{mid:7.3f}x [{low:.3f}, {high:.3f}]")
        print(f"{name:12} {cells[0]:>28} {cells[1]:>28}")


def main() -> None:
    if RUN < 2 or EVERY < 1 or ROUNDS < 1:
        sys.exit(f"--run must be >= 2 (its first block is not counted), --every and --rounds >= 1; got "
                 f"--run {RUN} --every {EVERY} --rounds {ROUNDS}")
    unknown = [name for name in ONLY if name not in ALL]
    if "none" not in ONLY or unknown:
        sys.exit(f"--only takes a comma-separated subset of {','.join(ALL)} that includes none (the baseline); "
                 f"got {','.join(ONLY)}")
    args = ["--worker", "--rounds", str(ROUNDS), "--run-blocks", str(RUN), "--every", str(EVERY),
            "--only", ",".join(ONLY)]
    rows = launch_json(os.path.abspath(__file__), RANKS, ENGINE, *args, timeout=900)
    threads = rows.pop("threads", None)
    report(rows)
    report_paired(rows)
    if threads:
        print(f"\n{threads_line({'threads': threads})}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
