"""The streamed hand-over on real worlds: torch/gloo at 2, 3 and 4 ranks, and MPI at 3 (one world each)."""

import pytest

from workers import torch_stream_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("torch", 2), ("torch", 3), ("torch", 4), ("mpi", 3)], timeout=30
)
