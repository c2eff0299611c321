"""The files a demo run leaves behind under runs/<time>/: returns.png, events.jsonl, history.jsonl and
summary.json (TensorBoard's files go to tb/ through popmesh.observe.board)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from popmesh.core.errors import ConfigError

__all__ = ["new_run_dir", "steps_to_target", "write_jsonl", "write_summary", "plot_returns", "read_history",
           "history_file", "best_curve"]


def new_run_dir(root: str | Path) -> Path:
    """``root/<YYYYmmdd-HHMMSS>`` (suffixed if it exists), created."""
    base = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


def steps_to_target(history: Sequence[dict[str, Any]], target: float) -> int | None:
    """First global env-step count at which some rank's mean return (last 20 episodes) ≥ target.

    ``history`` rows carry ``rank``, ``steps`` (that rank's steps so far), ``mean_return`` and
    ``time``; the population's steps at a moment are summed over ranks' latest counts.
    """
    latest: dict[int, int] = {}
    for row in sorted(history, key=lambda r: r["time"]):
        latest[row["rank"]] = row["steps"]
        value = row["mean_return"]
        if value is not None and not math.isnan(value) and value >= target:
            return sum(latest.values())
    return None


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """One JSON object per line, in time order (events, or the history's rows)."""
    with open(path, "w") as f:
        for record in sorted(records, key=lambda e: e.get("time", 0.0)):
            f.write(json.dumps(record) + "\n")


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2, default=float) + "\n")


def history_file(run: str | Path) -> Path:
    """An earlier run's ``history.jsonl`` (``run``: its folder); ConfigError if it has none."""
    path = Path(run) / "history.jsonl"
    if not path.is_file():
        raise ConfigError(f"--baseline {run}: no history.jsonl there (give a run folder that popmesh demo wrote)")
    return path


def read_history(run: str | Path) -> list[dict[str, Any]]:
    """The rows of an earlier run's ``history.jsonl`` (``run``: its folder); ConfigError if it has none."""
    return [json.loads(line) for line in history_file(run).read_text().splitlines() if line.strip()]


def best_curve(history: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The population's best mean return so far against env steps per rank, from every rank's rows."""
    latest: dict[int, float] = {}
    steps, best = [], []
    for row in sorted(history, key=lambda r: r["steps"]):
        if row["mean_return"] is not None:
            latest[row["rank"]] = row["mean_return"]
            steps.append(row["steps"])
            best.append(max(latest.values()))
    return steps, best


def plot_returns(path: Path, history: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]],
                 target: float, baseline: Sequence[dict[str, Any]] = (), baseline_label: str = "") -> None:
    """Each rank's mean return over its env steps, with replacement events marked; with ``baseline``
    (another run's history, e.g. ``--policy none``) that run's best agent as a dashed grey line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ranks = sorted({row["rank"] for row in history})
    for rank in ranks:
        rows = [r for r in history if r["rank"] == rank and r["mean_return"] is not None]
        (line,) = ax.plot([r["steps"] for r in rows], [r["mean_return"] for r in rows], label=f"rank {rank}", lw=1.4)
        mine = [e for e in events if e["rank"] == rank and "kind" not in e]
        ax.plot([e["steps"] for e in mine], [e.get("metric_before") or 0.0 for e in mine], ls="none", marker="v",
                color=line.get_color(), markeredgecolor="black", ms=7)
        for event in (e for e in events if e["rank"] == rank and e.get("kind") == "rejoined"):
            ax.axvline(event["steps"], color=line.get_color(), ls=":", lw=1.2)
            ax.annotate(f"rank {rank} lost, rejoined", (event["steps"], target), rotation=90, fontsize=7,
                        va="top", ha="right", color=line.get_color())
    if baseline:
        ax.plot(*best_curve(baseline), color="grey", ls="--", lw=1.6, label=f"best agent of {baseline_label}")
    ax.axhline(target, color="green", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("environment steps (per rank)")
    ax.set_ylabel("mean return, last 20 episodes")
    ax.set_title("CartPole-v1: one PPO agent per rank; ▼ = replaced by an average of better agents"
                 + ("\n┆ = a rank lost, then rejoined seeded by the best agents"
                    if any(e.get("kind") == "rejoined" for e in events) else ""), fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
