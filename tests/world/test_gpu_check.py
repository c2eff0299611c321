"""The prepared device check (benchmarks/gpu_check.py) rehearsed on CPU tensors over gloo, so that the
script a GPU machine runs keeps working between GPU runs. Its checks compare with closed forms."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.world
@pytest.mark.timeout(240)
def test_the_device_check_passes_on_cpu_tensors():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--only",
                           "collectives,population,gfn,survival,jax_fsdp"], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "5 of 5 parts right" in done.stdout and "lost_at_step 5" in done.stdout, done.stdout


@pytest.mark.timeout(30)
def test_an_unknown_part_is_refused_naming_the_parts():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--only", "collectives,nccl"],
                          capture_output=True, text=True, timeout=25)
    assert done.returncode == 2 and "unknown parts ['nccl']" in done.stderr and "grad_sync" in done.stderr
