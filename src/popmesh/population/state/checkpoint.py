"""Checkpoints of a whole population, written so that a torn one is never loaded.

Every rank saves its own agent (weights, optimizer state, hyper-parameters, counters, RNG states and
whatever else it hands over) with ``torch.save`` to ``DIR/ckpt-<iteration>/rank-<r>.pt``, each file
written under a temporary name, flushed, fsynced and renamed; after a barrier rank 0 writes the
manifest ``COMPLETE.json`` the same way (the sizes and SHA-256 of every rank's file, the world size,
the policy's own state), and only then does the checkpoint exist. :func:`latest_checkpoint` takes
the newest one whose manifest is there and whose files match it, so a checkpoint cut short by a
killed rank, a full disk or a lost node is skipped. Loading uses ``torch.load(weights_only=True)``:
tensors and plain values, no code. All ranks must see the same directory (one node, or a shared
file system).

While the world is short of a lost rank, its survivors can checkpoint over their own group
(``save(..., group=survivors)``): the manifest then names the population's ranks that had no agent to
write (``missing``), and a resumed run seeds those from the others (:func:`missing_ranks`, then
:func:`popmesh.population.state.rejoin.seed_newcomers` with ``newcomers=``), as a rejoined rank is seeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from popmesh.comm.collectives import all_gather_object, barrier
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError

__all__ = ["AgentState", "Checkpointer", "capture_rng", "restore_rng", "latest_checkpoint", "load_agent",
           "missing_ranks", "read_manifest"]

MANIFEST = "COMPLETE.json"
_PREFIX = "ckpt-"


@dataclass
class AgentState:
    """One agent of the population as a checkpoint holds it."""

    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any] | None = None
    hyper: Mapping[str, Any] = field(default_factory=dict)
    counters: Mapping[str, int | float] = field(default_factory=dict)
    rng: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": dict(self.model), "optimizer": self.optimizer, "hyper": dict(self.hyper),
                "counters": dict(self.counters), "rng": dict(self.rng), "extra": dict(self.extra)}


def capture_rng(generator: np.random.Generator | None = None) -> dict[str, Any]:
    """The states of torch's, Python's and (if given) a numpy Generator's random numbers."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if generator is not None:
        state["numpy"] = json.dumps(generator.bit_generator.state)
    return state


def restore_rng(state: Mapping[str, Any], generator: np.random.Generator | None = None) -> None:
    """Put back what :func:`capture_rng` took."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if generator is not None and "numpy" in state:
        generator.bit_generator.state = json.loads(state["numpy"])


class Checkpointer:
    """Population checkpoints in ``directory`` every ``every`` iterations (0: never), the newest
    ``keep`` of them kept. Every rank of ``group`` (the population; default the world) calls
    :meth:`save` at the same iterations, or every survivor while the world is short of a lost rank."""

    def __init__(self, directory: str | os.PathLike[str], every: int, *, keep: int = 2,
                 group: Comm | None = None) -> None:
        if every < 0 or keep < 1:
            raise ConfigError(f"checkpoint every {every} iterations, keeping {keep}: give every >= 0 and keep >= 1")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self._group = group
        self.seconds_spent = 0.0  # time in save(), on this rank
        self.saved = 0
        self._complete: set[Path] = set()  # checkpoints known complete (written here, or checked once)
        self._skip_through = 0

    def due(self, iteration: int) -> bool:
        """Whether :meth:`save` should run at ``iteration`` (every ``every``-th, not the first, and
        past :meth:`skip_through`)."""
        return self.every > 0 and iteration > max(0, self._skip_through) and iteration % self.every == 0

    def skip_through(self, iteration: int) -> None:
        """No checkpoint at or before ``iteration``. After a world re-formed, ranks stand at different
        iterations (some passed a checkpoint while a rank was lost, when none can be written): give
        the highest of them on every rank, so the next checkpoint is one every rank reaches."""
        self._skip_through = max(self._skip_through, int(iteration))

    def save(self, iteration: int, agent: AgentState, *, policy_state: Any = None, timeout: float | None = None,
             group: Comm | None = None) -> Path:
        """Write this rank's agent, then (the first rank, after every rank has) the manifest; the checkpoint's
        path. ``group``: the ranks that write, when not the whole population (the survivors of a lost
        rank, ``world.survivors()``); the manifest names the others ``missing``."""
        started = time.monotonic()
        population = resolve_group(self._group)
        comm = population if group is None else resolve_group(group)
        if not set(comm.ranks) <= set(population.ranks):
            raise ConfigError(f"checkpoint by ranks {list(comm.ranks)}: only ranks of the population "
                              f"{list(population.ranks)} can write its checkpoints")
        path = self.directory / f"{_PREFIX}{iteration:09d}"
        if comm.rank == comm.ranks[0]:
            path.mkdir(parents=True, exist_ok=True)
        barrier(group=comm, timeout=timeout)
        mine = path / f"rank-{comm.rank}.pt"
        _atomic_write(mine, lambda f: torch.save(agent.to_dict(), f))
        facts = {"file": mine.name, "bytes": mine.stat().st_size, "sha256": _sha256(mine)}
        files = list(all_gather_object(facts, group=comm, timeout=timeout))
        if comm.rank == comm.ranks[0]:
            missing = sorted(set(population.ranks) - set(comm.ranks))
            manifest = {"iteration": iteration, "world_size": population.size, "ranks": list(comm.ranks),
                        "missing": missing, "files": files, "time": time.time(), "policy_state": policy_state}
            _atomic_write(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            _fsync_dir(path)
            self._complete.add(path)  # its files' sizes and hashes are the ones just gathered
            self._prune()
        barrier(group=comm, timeout=timeout)
        self.saved += 1
        self.seconds_spent += time.monotonic() - started
        return path

    def _prune(self) -> None:
        """Remove the complete checkpoints beyond the newest ``keep`` (each folder is hashed once), and the
        torn ones older than the newest complete one (a save cut short by a loss or a re-forming)."""
        folders = _candidates(self.directory)
        complete = [p for p in folders if p in self._complete or _valid(p) is not None]
        self._complete.update(complete)
        for old in complete[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
            self._complete.discard(old)
        for torn in (p for p in folders if p not in self._complete and complete and p < complete[0]):
            shutil.rmtree(torn, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``directory`` (itself, if it is one), or None."""
    root = Path(directory)
    if (root / MANIFEST).exists():
        return root if _valid(root) is not None else None
    for path in _candidates(root):
        if _valid(path) is not None:
            return path
    return None


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; ConfigError if it is missing or does not match its files."""
    manifest = _valid(Path(path))
    if manifest is None:
        raise ConfigError(f"{path} is not a complete checkpoint (no manifest, or a file that does not match it): "
                          "pass a run folder or one of its complete checkpoints")
    return manifest


def missing_ranks(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The ranks of the population that had no agent in the checkpoint at ``path`` (lost when the survivors
    wrote it): a resumed run seeds them from the others. Empty for a checkpoint of the whole population."""
    return tuple(int(r) for r in read_manifest(path).get("missing", ()))


def load_agent(path: str | os.PathLike[str], rank: int, world_size: int) -> AgentState:
    """Rank ``rank``'s agent from the checkpoint at ``path`` (which must have ``world_size`` ranks)."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size:
        raise ConfigError(f"{path} holds a population of {manifest['world_size']} agents, but this world has "
                          f"{world_size} ranks: resume with {manifest['world_size']} ranks")
    if rank in manifest.get("missing", ()):
        raise ConfigError(f"rank {rank} was lost when {path} was written, so it holds no agent of rank {rank}: "
                          "seed it from the others (missing_ranks(path), then seed_newcomers(..., newcomers=...))")
    data = torch.load(Path(path) / f"rank-{rank}.pt", weights_only=True)
    return AgentState(model=data["model"], optimizer=data["optimizer"], hyper=data["hyper"],
                      counters=data["counters"], rng=data["rng"], extra=data["extra"])


def _candidates(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest iteration first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)), reverse=True)


def _valid(path: Path) -> dict[str, Any] | None:
    """The manifest if it exists, parses and every file it names has its size and hash; else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for entry in manifest["files"]:
            file = path / entry["file"]
            if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
                return None
        return dict(manifest)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync it, then rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
