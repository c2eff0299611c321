"""DESIGN.md's rules of the house, enforced: engines stay in engines/, importing popmesh starts nothing."""

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "popmesh"
ENGINE_IMPORT = re.compile(r"^\s*(import|from)\s+(torch\.distributed|mpi4py)\b", re.M)


def test_engine_imports_only_in_engines():
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("engines", "compat"):
            continue
        if ENGINE_IMPORT.search(path.read_text()):
            offenders.append(str(rel))
    assert not offenders, f"engine imports outside engines/: {offenders}"


def test_no_unfinished_markers():
    markers = re.compile(r"raise NotImplementedError|TODO|FIXME|XXX")
    hits = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if markers.search(p.read_text())]
    assert not hits, f"unfinished markers in {hits}"
