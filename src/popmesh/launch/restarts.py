"""``--max-restarts`` and elastic leaves: what the launcher does when one of its ranks fails.

:class:`Restarts` starts a failed rank again, with the same command and variables plus its restart count,
while the rank's budget lasts. In an elastic world (``--nnodes MIN:MAX``, torch engine) a rank past its
budget leaves for good instead of ending the world: a marker process started with the ranks
(:mod:`popmesh.engines.torch.store_client`) marks it left in the rendezvous store within milliseconds,
and the survivors re-form without it, unless the rank ended because its world fell below MIN nodes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import TextIO

from popmesh.launch.errorfile import read_error_file
from popmesh.launch.output import say
from popmesh.launch.plan import LaunchSpec, error_file_name
from popmesh.launch.result import exit_status
from popmesh.launch.runner import Child, Supervisor

__all__ = ["Restarts", "stop_helper"]


class Restarts:
    """``--max-restarts``: a failed rank's replacement, the same command and variables plus its restart
    count, while the rank's budget lasts; each restart is said on stderr and kept for the summary."""

    def __init__(self, spec: LaunchSpec, sup: Supervisor, worker: list[str], error_dir: str, err: TextIO,
                 python: str = sys.executable) -> None:
        self._spec, self._sup, self._worker, self._dir, self._err = spec, sup, worker, error_dir, err
        self._python = python
        self._envs: dict[int, tuple[dict[str, str], bool]] = {}
        self._counts: dict[int, int] = {}
        self._marker: subprocess.Popen[bytes] | None = None
        self._marked: list[int] = []
        self.notes: list[str] = []
        if (spec.max_restarts > 0 or spec.elastic) and spec.engine == "torch":
            sup.set_restart(self)

    def left(self, rank: int) -> int:
        """The restarts ``rank`` has left."""
        return self._spec.max_restarts - self._counts.get(rank, 0)

    def remember(self, rank: int, env: dict[str, str], inherit_output: bool) -> None:
        self._envs[rank] = (env, inherit_output)

    def __call__(self, child: Child) -> Child | None:
        assert child.rank is not None and child.returncode is not None
        code, sig = exit_status(child.returncode)
        how = f"was killed by {sig}" if sig else f"exited with code {code}"
        count = self._counts.get(child.rank, 0) + 1
        if count > self._spec.max_restarts:
            if self._spec.elastic and not self._stopped_world(child.rank):
                self._leave(child, how)
                return None
            say(self._err, f"popmesh launch: rank {child.rank} {how}; its {self._spec.max_restarts} restart(s) are "
                            "used up: tearing the world down")
            return None
        self._counts[child.rank] = count
        record = os.path.join(self._dir, error_file_name(child.rank))
        if os.path.exists(record):  # the replaced process's record stays, under another name
            os.replace(record, record[: -len(".json")] + f".restart-{count}.json")
        env, inherit_output = self._envs[child.rank]
        budget = self._spec.max_restarts
        note = f"rank {child.rank} {how} at {time.strftime('%H:%M:%S')}; restarted ({count} of {budget})"
        say(self._err, f"popmesh launch: {note}")
        self.notes.append(note)
        return self._sup.spawn(self._worker, {**env, "TORCHELASTIC_RESTART_COUNT": str(count)}, child.rank,
                               inherit_output=inherit_output)

    def _stopped_world(self, rank: int) -> bool:
        """Whether ``rank`` ended because its elastic world fell below MIN nodes (WorldTooSmall): then the
        world is torn down, not left."""
        record = read_error_file(os.path.join(self._dir, error_file_name(rank)))
        if record is None or not record.type.endswith("WorldTooSmall"):
            return False
        say(self._err, f"popmesh launch: rank {rank}'s world fell below --nnodes MIN={self._spec.nnodes}: "
                        "tearing it down")
        return True

    def _leave(self, child: Child, how: str) -> None:
        """An elastic world goes on without ``child``: its slot is marked left in the store (through the
        marker process, :mod:`popmesh.engines.torch.store_client`), so the next generation forms without it."""
        assert child.rank is not None
        child.left = True
        note = (f"rank {child.rank} {how} at {time.strftime('%H:%M:%S')}; no restart left (--max-restarts "
                f"{self._spec.max_restarts}): it left the world for good, which goes on without it")
        say(self._err, f"popmesh launch: {note}")
        self.notes.append(note)
        marker = self._marker
        if marker is None or marker.stdin is None or marker.poll() is not None:
            say(self._err, f"popmesh launch: cannot mark rank {child.rank} left: the store marker process ended")
            return
        with contextlib.suppress(OSError):
            marker.stdin.write(f"left {child.rank}\n".encode())
            marker.stdin.flush()
            self._marked.append(child.rank)

    def start_marker(self) -> None:
        """Start the process that marks lost ranks left (elastic worlds), with the ranks: it imports torch
        and connects while they start, so a mark costs milliseconds when a rank is lost."""
        if not self._spec.elastic or self._marker is not None:
            return
        command = [self._python, "-m", "popmesh.engines.torch.store_client", self._spec.master_addr,
                   str(self._spec.master_port)]
        self._marker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def close(self, timeout: float = 30.0) -> None:
        """End the marker once its marks are written (each gives up within its own timeout); say which failed
        (the store is gone where the whole world ended meanwhile)."""
        marker, self._marker = self._marker, None
        if marker is None:
            return
        try:
            said, _ = marker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_helper(marker)
            said, _ = marker.communicate()
        for line in said.decode(errors="replace").splitlines():
            if line.startswith("error "):
                _, rank, *why = line.split(" ", 2)
                say(self._err, f"popmesh launch: could not mark rank {rank} left in the rendezvous store "
                                f"({' '.join(why)})")
        if not said and self._marked:
            say(self._err, f"popmesh launch: the store marker ended without marking rank(s) {self._marked} left")


def stop_helper(proc: subprocess.Popen[bytes]) -> None:
    """End a helper process of the launcher: SIGTERM, then SIGKILL after a second."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
