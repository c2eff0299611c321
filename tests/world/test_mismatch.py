"""Mismatched collectives without check mode, on torch/gloo and MPI at 2 and 3 ranks: every rank raises
CollectiveMismatch within seconds (unchecked, gloo aborts the process and MPI returns partly reduced data
or times out), and the group goes on working (worlds shared with the other communication files: suite "comm")."""

import pytest

from workers import mismatch_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("torch", 2), ("torch", 3), ("mpi", 2), ("mpi", 3)], timeout=240, suite="comm"
)
