"""Does growing a population mid-run pay? examples/elastic_population.py to its target, three ways, seed by
seed (the order rotating each seed):

* **grows 2 -> 4**: node 0's launcher (``--nnodes 1:2 -n 2``) starts the run; node 1's (``-n 2``) is started
  once node 0 has reached iteration ``--grow-at``, and its two ranks join at the next decision after
  they are up, seeded from the two best agents;
* **4 from the start**: one launcher, ``-n 4``;
* **stays at 2**: one launcher, ``-n 2``.

Each agent fits a curve at its own learning rate (log-uniform over 1e-4..1e-1, the seed's); the population
decides every 20 iterations. It reports the iteration at which the best agent's squared error first
reached ``--target`` at a decision (the clock every agent shares), and the agent-iterations spent by then
(the compute: a rank's iterations count from its start, a newcomer's from the join). Medians, ranges, a
per-seed table and sign tests.

    python benchmarks/elastic_population.py [--seeds 10] [--target 0.0105] [--pace 0.05] [--grow-at 40]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from _common import free_port
from _pbt_tables import sign_test

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "elastic_population.py")
CONTENDERS = ("grows 2 -> 4", "4 from the start", "stays at 2")
_REACHED = re.compile(r"target \S+ reached at iteration (\d+) with (\d+) agents")
_GREW = re.compile(r"iteration (\d+): the world grew from 2 to 4 ranks")
_AT = re.compile(r"iteration (\d+): best squared error")


def _example(opts: argparse.Namespace, seed: int) -> list[str]:
    return [EXAMPLE, "--seed", str(seed), "--target", str(opts.target), "--pace", str(opts.pace),
            "--iterations", str(opts.iterations), "--log-every", "20"]


def _launcher(*options: str) -> list[str]:
    return [sys.executable, "-m", "popmesh", "launch", "--quiet-others", *options]


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=dict(os.environ, POPMESH_TIMEOUT="60"))
    if done.returncode:
        raise SystemExit(f"a run failed ({' '.join(argv)}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def fixed(opts: argparse.Namespace, seed: int, ranks: int) -> dict:
    out = _run(_launcher("-n", str(ranks), *_example(opts, seed)))
    reached = _REACHED.search(out)
    iteration = int(reached[1]) if reached else None
    return {"iteration": iteration, "agent_iterations": None if iteration is None else ranks * iteration,
            "grew_at": None}


def grows(opts: argparse.Namespace, seed: int) -> dict:
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "1:2", "-n", "2", "--rdzv-endpoint", endpoint]
    first = subprocess.Popen(_launcher(*common, "--node-rank", "0", *_example(opts, seed)), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, POPMESH_TIMEOUT="60"))
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert first.stdout is not None
        for line in first.stdout:
            lines.append(line)
            found = _AT.search(line)
            if found and int(found[1]) >= opts.grow_at:
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready.wait(timeout=600)
    later = subprocess.Popen(_launcher(*common, "--node-rank", "1", *_example(opts, seed)), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=dict(os.environ, POPMESH_TIMEOUT="60"))
    codes = (first.wait(timeout=900), later.wait(timeout=900))
    reader.join(timeout=10)
    out = "".join(lines)
    if any(codes):
        raise SystemExit(f"a growing run failed (exit codes {codes}):\n{out[-2000:]}")
    reached, grew = _REACHED.search(out), _GREW.search(out)
    iteration = int(reached[1]) if reached else None
    at = int(grew[1]) if grew else None
    if iteration is None:
        spent = None
    elif at is None or at > iteration:  # reached before the newcomers were in
        spent = 2 * iteration
    else:
        spent = 2 * at + 4 * (iteration - at)
    return {"iteration": iteration, "agent_iterations": spent, "grew_at": at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.0105, help="squared error (the noise alone is 0.01)")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds each iteration takes at least")
    parser.add_argument("--grow-at", type=int, default=40, help="node 1 starts once node 0 reached this iteration")
    parser.add_argument("--iterations", type=int, default=3000, help="the budget: a run that misses it counts as never")
    opts = parser.parse_args()
    runs: dict[str, dict[int, dict]] = {name: {} for name in CONTENDERS}
    for seed in range(opts.seeds):
        order = CONTENDERS[seed % 3:] + CONTENDERS[:seed % 3]
        for name in order:
            began = time.monotonic()
            result = grows(opts, seed) if name == CONTENDERS[0] else fixed(opts, seed, 4 if "4" in name else 2)
            runs[name][seed] = {**result, "wall": time.monotonic() - began}
        print(f"seed {seed}: " + "; ".join(f"{name} {runs[name][seed]['iteration']}" for name in CONTENDERS),
              flush=True)
    report(runs, opts)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})" if values else "-"


def report(runs: dict[str, dict[int, dict]], opts: argparse.Namespace) -> None:
    never = float("inf")
    print(f"\ntarget: squared error {opts.target:g}; pace {opts.pace:g} s; growth starts at iteration {opts.grow_at}; "
          f"{opts.seeds} seeds; a run that missed the {opts.iterations}-iteration budget counts as never")
    print("| contender | iterations to target | agent-iterations | reached |")
    print("|---|---|---|---|")
    for name in CONTENDERS:
        hit = [r for r in runs[name].values() if r["iteration"] is not None]
        print(f"| {name} | {_median([r['iteration'] for r in hit])} | {_median([r['agent_iterations'] for r in hit])} "
              f"| {len(hit)} of {len(runs[name])} |")
    grew = [r["grew_at"] for r in runs[CONTENDERS[0]].values() if r["grew_at"] is not None]
    print(f"the newcomers joined at iteration {_median(grew)} (median, range)")
    print("\n| seed | " + " | ".join(CONTENDERS) + " | joined at |")
    print("|---|" + "---|" * (len(CONTENDERS) + 1))
    for seed in sorted(runs[CONTENDERS[0]]):
        cells = [str(runs[name][seed]["iteration"] or "never") for name in CONTENDERS]
        print(f"| {seed} | " + " | ".join(cells) + f" | {runs[CONTENDERS[0]][seed]['grew_at'] or '-'} |")
    for other in CONTENDERS[1:]:
        pairs = [((runs[CONTENDERS[0]][s]["iteration"] or never), (runs[other][s]["iteration"] or never))
                 for s in runs[other]]
        wins, losses = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
        print(f"grows vs {other}: fewer iterations in {wins}, more in {losses}, equal in {len(pairs) - wins - losses}"
              f" (sign test p = {sign_test(wins, losses):.2f})")


if __name__ == "__main__":
    main()
