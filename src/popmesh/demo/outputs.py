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
from popmesh.demo.membership import summary_lines
from popmesh.observe.reports import print_report

__all__ = ["new_run_dir", "steps_to_target", "write_jsonl", "write_summary", "plot_returns", "read_history",
           "history_file", "best_curve", "print_summary"]


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
                 target: float, baseline: Sequence[dict[str, Any]] = (), baseline_label: str = "",
                 env: str = "CartPole-v1") -> None:
    """Each agent's mean return over its env steps (agents named by their launcher number, ``rank``), with a
    marker on the replaced agent's curve at each replacement (PBT's exploit: hollow ▼) or filled, with arrows
    naming what moved, when the explore step changed its values (``lr↑ ent↓``); with ``baseline`` (another
    run's history, e.g. ``--policy none``) that run's best agent as a dashed grey line. Below, each agent's
    learning rate and entropy coefficient (log scale), where the rows carry them: an exploit jumps to the
    donors' values, an explore moves them. A vertical line in the agent's colour marks where it rejoined
    after a loss (dotted), joined an elastic world (dash-dot) or left it for good (solid)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    panels = [name for name in _EXPLORED if any(row.get(name) for row in history)]
    fig = Figure(figsize=(8, 4.5 + 1.4 * len(panels)), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1 + len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [3.0] + [1.0] * len(panels)})[:, 0]
    ax = axes[0]
    for rank in sorted({row["rank"] for row in history}):
        rows = sorted((r for r in history if r["rank"] == rank), key=lambda r: r["steps"])
        curve = [r for r in rows if r["mean_return"] is not None]
        (line,) = ax.plot([r["steps"] for r in curve], [r["mean_return"] for r in curve], label=f"rank {rank}",
                          lw=1.4)
        _mark_replacements(ax, line.get_color(), curve, [e for e in events if e["rank"] == rank and "kind" not in e])
        for sub, name in zip(axes[1:], panels):
            kept = [r for r in rows if r.get(name)]
            sub.plot([r["steps"] for r in kept], [r[name] for r in kept], color=line.get_color(), lw=1.2)
        _mark_membership(ax, line.get_color(), rank, rows, [e for e in events if e["rank"] == rank], target)
    if baseline:
        ax.plot(*best_curve(baseline), color="grey", ls="--", lw=1.6, label=f"best agent of {baseline_label}")
    ax.axhline(target, color="green", ls="--", lw=1, label=f"target {target:g}")
    handles = [Line2D([], [], ls="none", marker="v", mfc="white", mec="grey", mew=1.3, label="replaced (exploit)"),
               Line2D([], [], ls="none", marker="v", mfc="grey", mec="black", label="replaced, then explored")]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + (handles if events else []), loc="best", fontsize=7,
              ncol=2)
    ax.set_ylabel("mean return, last 20 episodes")
    kinds = {e.get("kind") for e in events}
    ax.set_title(f"{env}: one PPO agent per rank; ▼ = replaced by an average of better agents"
                 + ("\n┆ = a rank lost, then rejoined seeded by the best agents" if "rejoined" in kinds else "")
                 + ("\n-· = a rank joined, seeded by the best agents; │ = a rank left for good"
                    if kinds & {"joined", "left"} else ""), fontsize=10)
    for sub, name in zip(axes[1:], panels):
        sub.set_yscale("log")
        sub.set_ylabel(name, fontsize=8)
    axes[-1].set_xlabel("environment steps (per rank)")
    for each in axes:
        each.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


_EXPLORED = ("lr", "ent_coef")  # the rows' explored values, drawn below the returns
_MEMBERSHIP = {"rejoined": (":", "lost, rejoined"), "joined": ("-.", "joined"), "left": ("-", "left")}


def _mark_membership(ax: Any, color: Any, rank: int, rows: Sequence[dict[str, Any]],
                     events: Sequence[dict[str, Any]], target: float) -> None:
    """A vertical line where agent ``rank`` rejoined, joined or left (at the steps its event names; a left
    agent without them: its last row's), annotated."""
    for event in events:
        if event.get("kind") not in _MEMBERSHIP:
            continue
        style, text = _MEMBERSHIP[event["kind"]]
        steps = event.get("steps")
        steps = rows[-1]["steps"] if steps is None and rows else steps
        if steps is None:
            continue
        ax.axvline(steps, color=color, ls=style, lw=1.2)
        together = event.get("newcomers") or [rank]  # ranks that joined together: one label, on the first's line
        if rank == together[0]:
            names = f"rank {rank}" if len(together) == 1 else f"ranks {', '.join(map(str, together))}"
            ax.annotate(f"{names} {text}", (steps, target), rotation=90, fontsize=7, va="top", ha="right",
                        color=color)


_SHORT = {"lr": "lr", "ent_coef": "ent"}


def _mark_replacements(ax: Any, color: Any, curve: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]]) -> None:
    """A ▼ on the agent's curve at each of its replacements: hollow when its values were only inherited,
    filled and annotated (``lr↑ ent↓``) when the explore step moved them."""
    import numpy as np

    if not curve or not events:
        return
    xs, ys = [r["steps"] for r in curve], [r["mean_return"] for r in curve]
    for event in events:
        y = event.get("metric_before")
        y = float(np.interp(event["steps"], xs, ys)) if y is None else y
        moved = [name for name in event.get("explored", ()) if f"{name}_inherited" in event and name in event]
        ax.plot([event["steps"]], [y], ls="none", marker="v", ms=7, mew=1.3, color=color,
                mec="black" if moved else color, mfc=color if moved else "white", zorder=3)
        if moved:
            text = " ".join(f"{_SHORT.get(n, n)}{'↑' if event[n] > event[f'{n}_inherited'] else '↓'}" for n in moved)
            ax.annotate(text, (event["steps"], y), xytext=(0, -11), textcoords="offset points", fontsize=6,
                        ha="center", va="top", color=color)


def print_summary(summary: dict[str, Any], times: Any, imbalance: Any, out: Any) -> None:
    """Rank 0, at the end: the agents, the replacements and the target, the timing reports (``times``,
    ``imbalance``), the restarts, joins and leaves, and the files written to ``out``."""
    print("\nagents at the end:")
    reference = summary["config"].get("reference")
    for agent in summary["agents"]:
        ret = "—" if agent["mean_return"] is None else f"{agent['mean_return']:.1f}"
        who = f"rank {agent['rank']}" + (" (reference)" if reference and agent["rank"] == 0 else "")
        print(f"  {who}: lr {agent['lr']:.1e}  ent_coef {agent['ent_coef']:.1e}  "
              f"steps {agent['steps']:,}  return (last 20) {ret}")
    reached = summary["reached_target"]
    print(f"replacements: {summary['replacements']};  target: "
          + (f"rank {reached['rank']} after {reached['agent_steps']:,} steps" if reached else "not reached"))
    print_report(times)
    print_report(imbalance)
    if summary["config"]["policy"] in ("async", "none"):
        print(f"(the {summary['config']['policy']} policy never makes a rank wait for another: 'waiting' above is "
              "what a run that synchronised every iteration would have spent waiting for its slowest rank)")
    for event in summary.get("restarts", ()):
        alone = max(event.get("iterations_alone") or [0])
        print(f"rank {event['rank']} was lost and rejoined after {event['downtime_s']:.1f} s at iteration "
              f"{event['iteration']}, seeded by mean({', '.join(f'rank {d}' for d in event['donors'])})"
              + (f"; the others trained on meanwhile (up to {alone} iterations)" if alone else ""))
    for line in summary_lines(summary):
        print(line)
    if summary.get("resumed_from"):
        print(f"resumed from {summary['resumed_from']}")
    if "checkpoints" in summary:
        c = summary["checkpoints"]
        print(f"checkpoints: {c['written']} written to {c['folder']} ({c['seconds']:.2f} s on rank 0)")
    print(f"\nwrote {out}/returns.png, {out}/events.jsonl, {out}/history.jsonl, {out}/summary.json, {out}/tb/ "
          f"(tensorboard --logdir), {out}/trace.json (https://ui.perfetto.dev)")
