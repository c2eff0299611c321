"""popmesh.compat.omnisafe: the seed document's signatures, and its examples on real torch worlds of 1, 2
and 3 ranks and an MPI world of 3 (the facade runs on either engine). The training files (population,
buffers, compat) share one world per engine and size."""

import subprocess
import sys
from pathlib import Path

import pytest

from workers import compat_omnisafe_worker as worker
from worldlib import checks_of
from worldtests import world_tests

pytest.importorskip("torch")
sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import facade_mismatches, require_seed

import popmesh.compat.omnisafe as omnisafe

SEED = "omnisafe.utils.distributed"
# Each function whose documentation has an example, and the worker check that runs it.
EXAMPLES = {
    "get_rank": "rank_and_size_inside_a_launched_world",
    "avg_tensor": "avg_tensor_example",
    "avg_grads": "avg_grads_example",
    "sync_params": "sync_params_example",
    "avg_params": "avg_params_example",
    "dist_avg": "dist_examples",
    "dist_sum": "dist_examples",
    "dist_max": "dist_examples",
    "dist_min": "dist_examples",
    "dist_statistics_scalar": "dist_statistics_scalar_example",
}


def test_facade_matches_the_seed_document():
    seed = require_seed(SEED)
    assert facade_mismatches(omnisafe, seed) == []


def test_every_documented_example_is_run():
    seed = require_seed(SEED)
    assert {name for name, entry in seed.entries.items() if entry.examples} == set(EXAMPLES)
    assert set(EXAMPLES.values()) <= set(checks_of(worker))


def test_a_world_of_one_without_init():
    code = ("import torch, popmesh.compat.omnisafe as o\n"
            "assert (o.get_rank(), o.world_size(), o.is_master()) == (0, 1, True)\n"
            "x = torch.tensor(2.0); o.avg_tensor(x); assert x.item() == 2.0\n"
            "assert o.dist_statistics_scalar(torch.tensor([1.0, 3.0]), True) == "
            "(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(3.0))\n"
            "assert o.fork(1) is False\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "POPMESH_ENGINE", "PMI_RANK", "OMPI_COMM_WORLD_RANK")}
    env["MASTER_ADDR"] = "127.0.0.1"  # a stray MASTER_ADDR is not a launched world (OmniSafe crashed)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


@pytest.mark.timeout(120)
def test_fork_relaunches_python_dash_m():
    """OmniSafe's tests/test_utils.py::test_distributed forks two ranks; here the program is a module."""
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE", "PMI_RANK")}
    env["PYTHONPATH"] = str(Path(__file__).parent / "scripts") + ":" + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "omnisafe_fork"], capture_output=True, text=True, timeout=100,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"CHILD rank={r} size=2 ok" in done.stdout for r in range(2)), done.stdout[-3000:]
    assert done.stdout.count("PARENT done") == 1, done.stdout[-3000:]


world_run, test_on_a_world, test_world_exits_cleanly = world_tests(
    worker, [("torch", 1), ("torch", 2), ("torch", 3), ("mpi", 3)], timeout=240, suite="training"
)
