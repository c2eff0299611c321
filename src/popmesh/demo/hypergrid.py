"""``popmesh demo --task hypergrid``: where its script is and what it is told (pure, but for the file check).

The hypergrid task runs ``examples/gfn_hypergrid.py`` of popmesh's source tree (a population of torchgfn
GFlowNets with a replay-buffer service; docs/population.md), so a clone installed with ``pip install -e``
has it; the demo passes on the options it shares with the CartPole task and whatever follows ``--``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from popmesh.core.errors import ConfigError

__all__ = ["PRELOAD", "RANKS", "POLICIES", "script_path", "script_args", "cores_note"]

# The ranks, and their restarts, are forked from one process that imported these (popmesh launch --preload).
PRELOAD = ("torch", "numpy", "gfn.gym", "gfn.gflownet", "gfn.estimators", "gfn.preprocessors", "gfn.utils.modules",
           "torch.utils.tensorboard")
RANKS = 6  # 4 trainers, a replay-buffer manager and the coordinator
POLICIES = {"async": "selective", "average-all": "average", "none": "none"}  # the demo's names -> the script's


def script_path(root: Path | None = None) -> Path:
    """``examples/gfn_hypergrid.py`` under ``root`` (default: the source tree this popmesh runs from).

    ConfigError where it is missing (popmesh installed from a wheel) or torchgfn is not installed."""
    tree = Path(__file__).resolve().parents[3] if root is None else root
    path = tree / "examples" / "gfn_hypergrid.py"
    if not path.is_file():
        raise ConfigError(f"--task hypergrid runs examples/gfn_hypergrid.py of popmesh's source tree, not found under "
                          f"{tree}: clone popmesh and install it with pip install -e '.[demo,gfn]', or run the script "
                          "itself: popmesh launch -n 6 examples/gfn_hypergrid.py")
    if importlib.util.find_spec("gfn") is None:
        raise ConfigError("--task hypergrid needs torchgfn: pip install '.[demo,gfn]' and then pip install --no-deps "
                          "torchgfn==2.4.1 (its numpy<2 pin is why it goes in without its dependencies)")
    return path


def script_args(policy: str, seed: int, lr_range: tuple[float, float], out: Path, kill: tuple[int, int] | None,
                extra: Sequence[str] = (), share: bool = False) -> list[str]:
    """The script's command line for the demo's options (``share``: --share-samples, the trainers sharing
    their trajectories); ``extra``: the options given after ``--``."""
    if policy not in POLICIES:
        raise ConfigError(f"--policy {policy}: with --task hypergrid choose one of {', '.join(POLICIES)}")
    args = ["--policy", POLICIES[policy], "--seed", str(seed), "--lr-range", f"{lr_range[0]:g}:{lr_range[1]:g}",
            "--out", str(out)]
    if kill is not None:
        args += ["--kill-rank", str(kill[0]), "--kill-at", str(kill[1])]
    if share:
        args.append("--share-trajectories")
    return args + list(extra)


def cores_note(ranks: int, cores: int, policy: str = "async") -> str:
    """What the demo says, once, when its ranks outnumber the cores."""
    waits = ("the population policy never waits for a trainer that is descheduled" if policy in ("async", "none")
             else f"--policy {policy} waits for the slowest trainer at each decision")
    return (f"popmesh demo: {ranks} ranks on {cores} CPU core{'s' if cores != 1 else ''} take turns on them. That is "
            f"fine for this demo: the replay-buffer manager and the coordinator mostly wait for messages, and {waits}.")
