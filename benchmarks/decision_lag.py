"""Decision lag of the asynchronous policy in the demo: iterations from a decision to its replacement.

Runs the demo (`popmesh demo`'s workers, 4 ranks, the demo's defaults) once per decision mode of
``AsyncSelectiveAveraging`` and reads each run's ``events.jsonl``: a replacement's lag is the
iteration at which the replaced rank applied it minus the iteration whose report decided it
(``iteration - decided_at``). Prints the median, the 95th percentile and the largest lag per mode.

* ``latest``: the policy's default (each report judged against the others' latest), what
  ``popmesh demo`` runs;
* ``complete``: decided once every rank reported the iteration (``popmesh demo --decide complete``).

    python benchmarks/decision_lag.py [--steps 120000] [--runs 1] [--modes latest complete]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def lags_of(events_path: Path) -> list[int]:
    """Applied minus decided iteration of every replacement in a demo run's events.jsonl."""
    lags = []
    for line in events_path.read_text().splitlines():
        event = json.loads(line)
        if "kind" not in event and "decided_at" in event:
            lags.append(int(event["iteration"]) - int(event["decided_at"]))
    return lags


def percentile(values: list[int], q: float) -> float:
    """The ``q``-th percentile, linear between order statistics (numpy's default)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_mode(mode: str, steps: int, seed: int, ranks: int, out: Path) -> tuple[list[int], float]:
    """One ``popmesh demo --decide mode`` run; its lags and wall seconds."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--ranks", str(ranks), "--seed", str(seed), "--steps", str(steps),
           "--decide", mode, "--out", str(out), "--no-live"]
    began = time.monotonic()
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    seconds = time.monotonic() - began
    (events,) = sorted(out.glob("*/events.jsonl"))
    return lags_of(events), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120_000, help="env steps per agent (the demo's default)")
    p.add_argument("--runs", type=int, default=1, help="runs per mode, the modes interleaved")
    p.add_argument("--seed", type=int, default=0, help="the first run's seed (run i uses seed + i)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["latest", "complete"], choices=["latest", "complete"])
    ns = p.parse_args()
    lags: dict[str, list[int]] = {m: [] for m in ns.modes}
    wall: dict[str, list[float]] = {m: [] for m in ns.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.runs):
            for mode in ns.modes if i % 2 == 0 else reversed(ns.modes):
                found, seconds = run_mode(mode, ns.steps, ns.seed + i, ns.ranks, Path(tmp) / f"{mode}-{i}")
                lags[mode] += found
                wall[mode].append(seconds)
                print(f"run {i} {mode}: {len(found)} replacements, lags {sorted(found)}, {seconds:.0f} s", flush=True)
    print(f"\n{ns.ranks} ranks, {ns.steps:,} steps per agent, {ns.runs} run(s) per mode, seeds {ns.seed}.."
          f"{ns.seed + ns.runs - 1}")
    print(f"{'mode':<10}{'replacements':>14}{'median lag':>12}{'p95 lag':>10}{'max lag':>10}{'wall s':>9}")
    for mode in ns.modes:
        found = lags[mode]
        median = statistics.median(found) if found else float("nan")
        print(f"{mode:<10}{len(found):>14}{median:>12g}{percentile(found, 95):>10.3g}"
              f"{max(found, default=0):>10}{statistics.median(wall[mode]):>9.0f}")


if __name__ == "__main__":
    main()
