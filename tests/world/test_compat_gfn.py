"""popmesh.compat.gfn: the seed document's signatures, and its behaviours on real worlds of 1, 2 and 3 ranks
(torch, MPI). The training files (population, buffers, compat) share one world per engine and size."""

import logging
import sys
from pathlib import Path

import pytest

from workers import compat_gfn_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")
sys.path.append(str(Path(__file__).resolve().parents[1] / "unit"))  # the seed-document parser
from seed_signatures import attribute_mismatches, facade_mismatches, require_seed

import popmesh.compat.gfn as gfn

SEED = "gfn.utils.distributed"


def test_facade_matches_the_seed_document():
    seed = require_seed(SEED)
    assert facade_mismatches(gfn, seed) == []
    assert not any(entry.examples for entry in seed.entries.values())  # behaviours are checked one by one


def test_context_classes_have_the_documented_attributes():
    seed = require_seed(SEED)
    for cls in ("DistributedContext", "DistributedContextMPI4Py"):
        fields = set(getattr(gfn, cls).__dataclass_fields__)
        missing = [m for m in attribute_mismatches(object(), seed, cls) if m.split(".")[1].split(":")[0] not in fields]
        assert missing == [], missing


def test_reports_tolerate_ragged_iterations(caplog):
    timings = [{"step": [1.0, 1.0, 1.0], "only0": [0.5]}, {"step": [2.0]}]  # rank 1 ran fewer iterations
    with caplog.at_level(logging.INFO, logger="popmesh.compat.gfn"):
        assert gfn.report_time_info(timings, 2) is None
        assert gfn.report_load_imbalance(timings, 2) is None
    text = caplog.text
    assert "step" in text and len(caplog.records) == 2, text


world_run, test_on_a_world, test_world_exits_cleanly = world_tests(
    worker, [("torch", 1), ("torch", 2), ("torch", 3), ("mpi", 1), ("mpi", 2), ("mpi", 3)],
    timeout=240, suite="training",
)
