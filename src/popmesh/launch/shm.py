"""Remove the shared-memory segments that a failed MPICH job leaves in ``/dev/shm``.

MPICH (ch4's POSIX shared memory) creates ``/dev/shm/mpich_shm_<world>_<node>`` (and ``mpich_vci_*``)
in ``MPI_Init`` and unlinks it in ``MPI_Finalize``; when a rank is killed or the job aborts nobody
finalizes, and the segment (about 3 MB) stays until reboot.

The launcher works out its own job's names rather than guessing from what appeared in ``/dev/shm``
meanwhile (another job may have created those). ``<world>`` is MPICH's ``world_id``, the 32-bit
FNV-1a hash of the PMI job name (MPICH 5.0; later versions hash ``"<job name>-<init count>"``), and
Hydra names the job ``kvs_<mpiexec pid>_0_<rand()>_<host name>``, its ``rand()`` seeded with the
second at which mpiexec started (glibc's generator). From mpiexec's pid and start time the launcher
computes the few names its job can have had, and after mpiexec has exited removes those that exist
and were not there before the launch. A segment of any other job has another mpiexec pid or start
second in its name; a match by chance has odds of 2^-32 per name.

A job run by another mpiexec than Hydra, or an MPICH that names its segments otherwise, matches
nothing, and nothing is removed. Linux only (``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterable

__all__ = ["SegmentSweep", "SHM_DIR", "glibc_first_rand", "fnv1a_32", "hydra_segment_names"]

SHM_DIR = "/dev/shm"
_PREFIXES = ("mpich_shm_", "mpich_vci_")
_SEED_SLACK_S = 120  # mpiexec names its job at start-up; allow this long for a slow start


class SegmentSweep:
    """The segments one Hydra job leaves: create it just before mpiexec starts, :meth:`sweep` after it exits."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.started = time.time()
        self._before = self._names()

    def sweep(self, mpiexec_pid: int, hostname: str | None = None) -> list[str]:
        """Unlink this job's segments that are still there (none after a clean finalize); return their names."""
        new = self._names() - self._before
        if not new:
            return []
        first = int(self.started) - 1
        seeds = range(first, min(int(time.time()), first + _SEED_SLACK_S) + 1)
        ours = new & hydra_segment_names(mpiexec_pid, seeds, hostname or socket.gethostname())
        removed = []
        for name in sorted(ours):
            with contextlib.suppress(OSError):  # finalized meanwhile, or not ours to remove
                os.unlink(os.path.join(self.shm_dir, name))
                removed.append(name)
        return removed

    def _names(self) -> set[str]:
        try:
            return {name for name in os.listdir(self.shm_dir) if name.startswith(_PREFIXES)}
        except OSError:  # no /dev/shm (not Linux)
            return set()


def hydra_segment_names(mpiexec_pid: int, seeds: Iterable[int], hostname: str) -> set[str]:
    """Every segment name of node 0 that a Hydra job of ``mpiexec_pid`` started in one of ``seeds`` may use."""
    names = set()
    for seed in seeds:
        job = f"kvs_{mpiexec_pid}_0_{glibc_first_rand(seed)}_{hostname}"
        for key in (job, f"{job}-1"):  # MPICH 5.0 hashes the job name; later versions add the init count
            world = fnv1a_32(key.encode())
            names |= {f"{prefix}{world:x}_0" for prefix in _PREFIXES}
    return names


def fnv1a_32(data: bytes) -> int:
    """32-bit FNV-1a, as uthash's ``HASH_FNV`` that MPICH uses for its ``world_id``."""
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def glibc_first_rand(seed: int) -> int:
    """The first ``rand()`` after ``srand(seed)`` in glibc (its default additive feedback generator)."""
    r = [(seed & 0xFFFFFFFF) or 1]
    for i in range(1, 31):  # r[i] = 16807 * r[i-1] % (2**31 - 1), on int32 with C's truncating division
        word = _int32(r[i - 1])
        hi = -(-word // 127773) if word < 0 else word // 127773
        word = 16807 * (word - hi * 127773) - 2836 * hi
        r.append(word + 2147483647 if word < 0 else word)
    r.extend(r[0:3])
    for i in range(34, 345):  # the first 310 outputs are discarded; r[344] gives the first
        r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
    return r[344] >> 1


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
