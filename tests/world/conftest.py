"""World tests: the harness modules are importable, and fixtures several files share."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def piddir(tmp_path: Path) -> Path:
    """An empty directory where a world's ranks write their pids (or readiness files)."""
    d = tmp_path / "pids"
    d.mkdir()
    return d
