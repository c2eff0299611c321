"""``popmesh launch --inject-failures RATE``: kill random ranks on purpose, within the restart budget.

Users test that their own scripts survive a lost rank the way torchft's punisher and Monarch's
FailureController let them: the launcher SIGKILLs a random live rank at random times (a Poisson
process of ``RATE`` kills per minute, after ``--inject-after`` seconds, reproducible with
``--inject-seed``), but only a rank that has a restart left, so the injected failures alone never end
the run. Each kill is said on stderr, kept for the launch summary, and appended to
``failures.jsonl`` in the run's log folder (``--log-dir``) as one JSON object per kill: ``kind``
("injected"), ``rank``, ``signal``, ``time`` (wall clock), ``after_s`` (since the launch) and
``restarts_left`` (the rank's, before the restart this kill uses).

The decisions (the next delay, which rank) are pure functions of a seeded generator; the thread that
sleeps and kills is :class:`FailureInjector`.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from popmesh.core.errors import ConfigError

__all__ = ["FailureInjection", "FailureInjector", "check_injection", "next_delay", "pick_victim"]

RECORD_FILE = "failures.jsonl"


@dataclass(frozen=True)
class FailureInjection:
    """What ``--inject-failures`` asks for: ``per_minute`` kills on average, the first possible one
    ``after_s`` seconds into the launch, drawn from ``seed``; at most ``limit`` kills (None: as many
    as the restart budget allows)."""

    per_minute: float
    seed: int = 0
    after_s: float = 10.0
    limit: int | None = None


def check_injection(injection: FailureInjection, engine: str, max_restarts: int) -> None:
    """ConfigError unless the injection can run: a positive rate, and restarts to spend them on."""
    if not (math.isfinite(injection.per_minute) and injection.per_minute > 0):
        raise ConfigError(f"--inject-failures {injection.per_minute}: give the mean number of kills per minute, "
                          "a positive number such as 2")
    if not (math.isfinite(injection.after_s) and injection.after_s >= 0):
        raise ConfigError(f"--inject-after {injection.after_s}: give the seconds before the first kill, 0 or more")
    if injection.limit is not None and injection.limit < 1:
        raise ConfigError(f"--inject-max {injection.limit}: give the most kills to inject, 1 or more")
    if engine != "torch":
        raise ConfigError(f"--inject-failures with --engine {engine}: only the torch engine restarts a lost rank "
                          "in a running world; use --engine torch")
    if max_restarts < 1:
        raise ConfigError("--inject-failures kills ranks within the restart budget, and there is none: add "
                          "--max-restarts N (N restarts per rank)")


def next_delay(rng: random.Random, per_minute: float) -> float:
    """Seconds to the next kill: exponential with mean ``60 / per_minute`` (a Poisson process)."""
    return rng.expovariate(per_minute / 60.0)


def pick_victim(rng: random.Random, candidates: Sequence[int]) -> int | None:
    """A rank drawn uniformly from ``candidates`` (live, with a restart left); None if there is none."""
    return rng.choice(sorted(candidates)) if candidates else None


class FailureInjector:
    """The thread that kills: ``candidates()`` gives the live ranks with a restart left and their
    process group ids, ``left(rank)`` a rank's restarts left; ``record`` is the log folder's
    ``failures.jsonl`` (None: stderr and the summary only); ``say`` writes one line for the user;
    ``notes`` is the list the launch summary prints, where each kill is appended."""

    def __init__(self, injection: FailureInjection, candidates: Callable[[], dict[int, int]],
                 left: Callable[[int], int], say: Callable[[str], None], record: Path | None,
                 notes: list[str]) -> None:
        self.injection, self._candidates, self._left, self._say, self._record = injection, candidates, left, say, record
        self.notes = notes  # the launch summary's notes, shared with the restarts'
        self.kills = 0
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="popmesh-inject-failures", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Kill no more (the world is ending); returns once the thread has."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        rng = random.Random(self.injection.seed)
        if self._stop.wait(self.injection.after_s):
            return
        while self.injection.limit is None or self.kills < self.injection.limit:
            if self._stop.wait(next_delay(rng, self.injection.per_minute)):
                return
            live = self._candidates()
            rank = pick_victim(rng, list(live))
            if rank is None:
                continue  # every rank is starting or out of restarts: try again at the next draw
            left = self._left(rank)
            try:
                os.killpg(live[rank], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue  # it ended by itself meanwhile
            self.kills += 1
            self._note(rank, left)

    def _note(self, rank: int, left: int) -> None:
        now = time.time()
        note = f"injected failure {self.kills}: SIGKILL to rank {rank} at {time.strftime('%H:%M:%S')} " \
               f"({left} restart(s) left)"
        self.notes.append(note)
        self._say(f"popmesh launch: {note}")
        if self._record is not None:
            line = {"kind": "injected", "rank": rank, "signal": "SIGKILL", "time": now,
                    "after_s": round(time.monotonic() - self._started, 3), "restarts_left": left}
            try:
                with open(self._record, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as e:
                self._say(f"popmesh launch: could not record the injected failure in {self._record}: {e}")
