"""The project's text says what is, not how it came to be (the house style: history belongs in
CHANGELOG.md, by version).

Every README, docs page, source file, benchmark, test and example is scanned for the phrases of a
work log: numbered periods of work, named assistants, shared machine locks, repeated runs, issue
numbers cited as history, accounts of what a change did. Each hit is reported as
``file:line: phrase``, one test per file. CHANGELOG.md is the one place for what changed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()

SCANNED = ("README.md", "docs", "src", "benchmarks", "tests", "examples")
SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".sbatch", ".txt", ".toml", ".yml", ".yaml", ".cfg"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

# Each pattern names one kind of work-log phrase; matched case-insensitively, line by line.
PATTERNS: dict[str, re.Pattern[str]] = {name: re.compile(rx, re.IGNORECASE) for name, rx in {
    "numbered session": r"\bsessions?[\s-]+\d+",
    "session as a period of work": r"\b(this|last|previous|earlier|next|that)\s+sessions?\b",
    "someone else's session": r"\b(an)?other\s+sessions?\b|\bhelper\s+sessions?\b",
    "numbered period": r"\bwork\s+periods?\b",
    "named helper": r"\bhelpers?[\s-]\d+"
                    r"|\b(a|one|the|another)\s+helper('s)?\s+(found|noted|noticed|reviewed|review|saw|reported|ran)\b",
    "shared lock": r"\bcpu[\s.-]lock\b|\bunder\s+(the\s+|a\s+)?shared\s+lock\b",
    "other people": r"\bother\s+engineers\b",
    "re-run": r"\bre-?run\s+(after|with\s+the|since)\b|\bre-?ran\b",
    "issue cited": r"\bissues?\s+#\d+|(?:^|[\s(\[])#\d{1,3}(?=[\s:;,.)\]'\u2019]|$)",
    "found by": r"\bfound\s+by\s+(a\s+|the\s+)?(helper|review|session)",
    "review repairs": r"\breview'?s?\s+mends?\b|\bmended\s+in\b",
    "before/after a change": r"\b(before|after|since)\s+(this|that|the)\s+(change|fix|commit|merge|regroup)\b",
    "the code before": r"\bthe\s+code\s+before\s+(this|the|it\b|issue)",
}.items()}


def skipped(path: Path) -> bool:
    """Caches and build metadata: not the project's text."""
    return any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in path.parts)


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        if top.is_file():
            files.append(top)
        elif top.is_dir():
            files.extend(p for p in top.rglob("*") if p.is_file() and p.suffix in SUFFIXES and not skipped(p))
    return sorted(p for p in files if p.resolve() != SELF)


def work_log_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, the phrase) for every work-log phrase in ``text``."""
    hits: list[tuple[int, str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name, pattern in PATTERNS.items():
            hits.extend((number, name, m.group(0).strip()) for m in pattern.finditer(line))
    return hits


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log(path: Path) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    hits = work_log_hits(text)
    where = path.relative_to(ROOT)
    assert not hits, "work-log phrases (history goes in CHANGELOG.md):\n" + "\n".join(
        f"{where}:{n}: {phrase!r} ({name})" for n, name, phrase in hits)


# Known work-log lines, each written in two halves joined at run time, so that this file does not
# itself read as the kind of text it rejects.
CAUGHT = [
    ("### The MPI C path (iss", "ue #", "22, ses", "sion 19)"),
    ("the survivors' wait (ses", "sion 13), under the shared CPU lo", "ck"),
    ("in this ses", "sion's runs"),
    ("a helper (hel", "per-15) reviewed the C code"),
    ("Re-", "run after the house regroup"),
    ("found by hel", "per-14"),
    ("the review's me", "nds"),
    ("#", "23: ten more seeds"),
    ("a known limit (#", "21)"),
    ("before this ch", "ange it was 1.2x"),
    ("the VM was shared with two helper ses", "sions' test runs"),
    ("flock /tmp/popmesh-cpu.lo", "ck"),
    ("[survival](performance.md#restarts-forked-from-a-fork-server-ses", "sion-16)"),
]


@pytest.mark.parametrize("halves", CAUGHT)
def test_patterns_catch_work_log(halves: tuple[str, ...]) -> None:
    line = "".join(halves)
    assert work_log_hits(line), line


@pytest.mark.parametrize("line", [
    "Every child starts in its own session (its own process group)",
    "@pytest.fixture(autouse=True, scope=\"session\")",
    "subprocess.Popen(cmd, start_new_session=True)",
    "JAX helpers, FSDP, multi-process JAX",
    "one helper instead of two of the same shape",
    "the upstream's private helper",
    "(found by rank {sender})",
    "Any run of failed ranks is found by the live rank after its last member",
    "a rank that failed before the barrier",
    "Run a script again to check a figure on your own machine.",
    "the transport's lock around each probe",
    "see [Collectives](collectives.md#mismatched-calls)",
    "x = y  # 12 bytes, then the header",
    "the review of a PR is ordinary English",
])
def test_patterns_spare_legitimate_text(line: str) -> None:
    assert not work_log_hits(line), work_log_hits(line)
