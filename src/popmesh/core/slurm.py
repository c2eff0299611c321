"""Slurm: who this task is, read from the variables ``srun`` sets (pure functions, no subprocess).

Under ``srun python train.py`` every task sees ``SLURM_PROCID`` (its rank), ``SLURM_NTASKS`` (the
world size), ``SLURM_LOCALID`` and ``SLURM_NODEID``, and the step's node list in Slurm's compressed
hostlist syntax (``SLURM_STEP_NODELIST``, e.g. ``gpu[01-03,07],login2``). The master is the first
host of that list; the port is ``MASTER_PORT`` when set, else derived from the job id so that two
jobs sharing a node do not collide. A batch script's own process (no ``srun``) is not a task of a
step: it has no ``SLURM_STEP_ID`` and runs a world of one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from popmesh.core.errors import ConfigError

__all__ = ["SlurmTask", "read_slurm", "expand_hostlist", "tasks_per_node", "PORT_BASE", "PORT_SPAN"]

PORT_BASE = 15000  # derived ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's ephemeral range
PORT_SPAN = 15000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SlurmTask:
    """This task of a Slurm job step."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    node_rank: int
    nodes: tuple[str, ...]
    job_id: str
    master_addr: str
    master_port: int  # derived from the job id

    def torch_variables(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables torchrun would have set for this task (MASTER_ADDR/PORT kept when set)."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "GROUP_RANK": str(self.node_rank), "MASTER_ADDR": environ.get("MASTER_ADDR") or self.master_addr,
               "MASTER_PORT": environ.get("MASTER_PORT") or str(self.master_port)}
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return out


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax expanded: ``a[1-3,7],b`` → ``a1 a2 a3 a7 b``; zero padding kept
    (``n[08-10]`` → ``n08 n09 n10``); several bracket groups multiply (``r[1-2]-n[1-2]``)."""
    hosts: list[str] = []
    for item in _split_top_level(spec.strip()):
        hosts.extend(_expand_item(item, spec))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {spec!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {spec!r}: unbalanced '['")
    items.append(spec[start:])
    return [item for item in items if item]


def _expand_item(item: str, spec: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    out: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ConfigError(f"node list {spec!r}: {part!r} is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ConfigError(f"node list {spec!r}: the range {part!r} runs backwards")
        width = len(low)
        for number in range(int(low), int(high) + 1):
            out.extend(head + str(number).zfill(width) + rest for rest in _expand_item(tail, spec))
    return out


def tasks_per_node(spec: str, node_rank: int) -> int | None:
    """Tasks on node ``node_rank`` from ``SLURM_STEP_TASKS_PER_NODE`` syntax (``2(x3),1``), or None."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_rank] if 0 <= node_rank < len(counts) else None


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (set by srun?)") from None


def read_slurm(environ: Mapping[str, str]) -> SlurmTask | None:
    """This process as a task of a Slurm step (started by ``srun``), or None outside one."""
    if not environ.get("SLURM_PROCID") or not environ.get("SLURM_NTASKS"):
        return None
    if not (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")):
        return None  # the batch script itself, not a task of a step
    rank, size = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    if not 0 <= rank < size:
        raise ConfigError(f"SLURM_PROCID={rank} is not in [0, SLURM_NTASKS={size})")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    nodes = tuple(expand_hostlist(nodelist)) if nodelist else ()
    node_rank = _int(environ, "SLURM_NODEID") if environ.get("SLURM_NODEID") else 0
    local_rank = _int(environ, "SLURM_LOCALID") if environ.get("SLURM_LOCALID") else 0
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "0"
    master = environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    port = PORT_BASE + int(job_id) % PORT_SPAN if job_id.isdecimal() else PORT_BASE
    return SlurmTask(rank, size, local_rank, tasks_per_node(per_node, node_rank) if per_node else None, node_rank,
                     nodes, job_id, master, port)
