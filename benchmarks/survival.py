"""A lost rank in a population run: popmesh's survivors carry on, against a torchrun-style restart.

For each seed, three runs of `popmesh demo` (4 ranks, CartPole, async policy, --stop-at-target):

* undisturbed;
* **survive**: one rank (drawn from 1..3 by the seed; rank 0 holds the run's history) SIGKILLs
  itself at an iteration drawn from the middle third of the undisturbed run's iterations to the
  target, under `--max-restarts 1`: the survivors go on as a population of three (their policy
  decides among them) while it restarts, then re-form the world with its restarted process, which
  is seeded from the best agents and trains on;
* **whole restart**, what torchrun does: the same kill with `--checkpoint-every K` and no restarts,
  so the launcher tears the world down; then `popmesh demo --resume` starts every rank again from the
  newest complete checkpoint (the iterations since it are lost and trained again).

It prints per run the env steps per agent to the target (the best agent's last-20 mean return >= 475;
for the whole restart also counting the iterations between the checkpoint and the kill, trained twice),
the wall time (both processes for the whole restart), and for survive the downtime (kill to rejoin)
and whether every survivor's iterations ran on (none repeated), the survivors' longest wait in the
re-form, the iterations they trained while the lost rank restarted and the replacements their
policy made among them meanwhile; then medians.

    python benchmarks/survival.py [--seeds 5] [--checkpoint-every 10] [--steps 150000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS_PER_ITERATION = 512  # the demo's rollout (64 steps) times its environments per agent (8)


def demo(out: Path, seed: int, steps: int, *extra: str, check: bool = True) -> tuple[dict[str, Any] | None, float]:
    """One `popmesh demo` run into ``out``: its summary (None if the run died) and its wall time."""
    cmd = [sys.executable, "-m", "popmesh", "demo", "--seed", str(seed), "--steps", str(steps), "--ranks", "4",
           "--stop-at-target", "--no-live", "--out", str(out), *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, timeout=1200, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if check and done.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"survival-seed{seed}-{out.name}.log"  # the whole story, for a diagnosis
        kept.write_text(done.stdout + "\n---- stderr ----\n" + done.stderr)
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}), output in {kept}:\n{done.stderr[-3000:]}")
    summaries = sorted(out.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    fresh = [p for p in summaries if p.stat().st_mtime >= time.time() - seconds - 1]
    return (json.loads(fresh[-1].read_text()) if fresh and done.returncode == 0 else None), seconds


def steps_to_target(summary: dict[str, Any] | None) -> int | None:
    reached = summary and summary.get("reached_target")
    return int(reached["agent_steps"]) if reached else None


def survivors_never_repeat(run_dir: Path, victim: int) -> bool:
    """Every survivor's iterations ran on: its rows (history.jsonl) never repeat an iteration, as a
    rank restarted from a checkpoint would."""
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()] \
        if (run_dir / "history.jsonl").exists() else []
    for rank in {r["rank"] for r in rows} - {victim}:
        its = [r["iteration"] for r in rows if r["rank"] == rank]
        if its != sorted(set(its)):
            return False
    return True


def replacements_while_short(run_dir: Path) -> int:
    """Replacements the survivors' policy made among them between the loss and the rejoin (events.jsonl)."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    lost = next((e["time"] for e in events if e.get("kind") == "lost"), None)
    back = next((e["time"] for e in events if e.get("kind") == "rejoined"), None)
    if lost is None or back is None:
        return 0
    return sum(1 for e in events if "kind" not in e and lost < e["time"] < back)


def one_seed(seed: int, steps: int, every: int) -> dict[str, Any]:
    gen = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        calm, calm_s = demo(root / "calm", seed, steps)
        assert calm is not None
        target_it = int(calm["reached_target"]["iteration"]) if calm["reached_target"] else steps // 512
        victim, kill_at = gen.randint(1, 3), gen.randint(target_it // 3, 2 * target_it // 3)
        kill = f"{victim}:{kill_at}"
        survived, survive_s = demo(root / "survive", seed, steps, "--max-restarts", "1", "--kill", kill)
        assert survived is not None
        rejoin = survived["restarts"][0] if survived["restarts"] else {}
        ran_on = survivors_never_repeat(next((root / "survive").iterdir()), victim)
        meanwhile = replacements_while_short(next((root / "survive").iterdir()))
        _, died_s = demo(root / "whole", seed, steps, "--checkpoint-every", str(every), "--kill", kill, check=False)
        first = next((root / "whole").iterdir())
        resumed, resume_s = demo(root / "whole", seed, steps, "--checkpoint-every", str(every), "--resume", str(first))
        assert resumed is not None
    resumed_at = int(str(resumed.get("resumed_from")).rsplit("-", 1)[-1])
    redone = (kill_at - resumed_at) * STEPS_PER_ITERATION  # per agent: trained before the kill, lost, trained again
    whole = steps_to_target(resumed)
    return {"seed": seed, "kill": kill, "calm_steps": steps_to_target(calm), "calm_s": round(calm_s, 1),
            "survive_steps": steps_to_target(survived), "survive_s": round(survive_s, 1),
            "downtime_s": rejoin.get("downtime_s"), "survivors_ran_on": ran_on,
            # the survivors train on together while the lost rank restarts, then wait only for each other
            "survivor_wait_s": max(_survivors(rejoin, "survivor_wait_s", victim), default=None),
            "survivor_leaving_s": max(_survivors(rejoin, "survivor_leaving_s", victim), default=None),
            "survivor_iterations_alone": min(_survivors(rejoin, "iterations_alone", victim), default=None),
            "replacements_while_short": meanwhile,
            "whole_steps": whole, "whole_redone_steps": redone, "whole_computed_steps": whole and whole + redone,
            "whole_s": round(died_s + resume_s, 1),
            "resumed_from": resumed.get("resumed_from")}


def _survivors(rejoin: dict[str, Any], field: str, victim: int) -> list[Any]:
    """The survivors' entries of a per-rank list in the rejoin event (none where the event lacks the field)."""
    return [v for rank, v in enumerate(rejoin.get(field) or []) if rank != victim]


def median(values: list[Any]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):,.1f}" if known else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="the whole restart's checkpoint cadence")
    parser.add_argument("--steps", type=int, default=150_000, help="cap on env steps per agent")
    ns = parser.parse_args()
    rows = []
    for seed in range(ns.first_seed, ns.first_seed + ns.seeds):
        rows.append(one_seed(seed, ns.steps, ns.checkpoint_every))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| run | median steps to 475 | vs undisturbed | median wall s | per seed (steps) |")
    print("|---|---|---|---|---|")
    calm = statistics.median(r["calm_steps"] for r in rows if r["calm_steps"])
    runs = (("undisturbed", "calm", "calm_steps"), ("survive (--max-restarts 1)", "survive", "survive_steps"),
            (f"whole restart from checkpoint (every {ns.checkpoint_every})", "whole", "whole_steps"),
            ("  the same, counting the iterations trained twice", "whole", "whole_computed_steps"))
    for name, key, field in runs:
        values = [r[field] for r in rows]
        known = [v for v in values if v]
        ratio = f"{statistics.median(known) / calm:.2f}x" if known else "—"
        per_seed = ", ".join("—" if v is None else f"{v:,}" for v in values)
        print(f"| {name} | {median(values)} | {ratio} | {median([r[f'{key}_s'] for r in rows])} | {per_seed} |")
    print(f"\nsurvive: downtime kill → rejoined, median {median([r['downtime_s'] for r in rows])} s "
          f"(per seed {[r['downtime_s'] for r in rows]}); survivors repeated no iteration in "
          f"{sum(r['survivors_ran_on'] for r in rows)} of {len(rows)} runs")
    print(f"survivors waited (longest per run) median {median([r['survivor_wait_s'] for r in rows])} s "
          f"(per seed {[r['survivor_wait_s'] for r in rows]}), having trained on for at least "
          f"{[r['survivor_iterations_alone'] for r in rows]} iterations meanwhile, with "
          f"{[r['replacements_while_short'] for r in rows]} replacements among them; leaving the broken world "
          f"and forming their group took them (longest per run) {[r['survivor_leaving_s'] for r in rows]} s")


if __name__ == "__main__":
    main()
