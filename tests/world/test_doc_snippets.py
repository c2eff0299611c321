"""Every Python block of the docs runs: README.md and docs/**/*.md.

An HTML comment on the line before a ```` ```python ```` block says how it runs (GitHub and the docs
site show neither the comment nor anything else of it):

* no comment (or ``<!-- run: python -->``): ``python block.py``, a world of one (the local engine);
* ``<!-- run: popmesh launch -n N [OPTIONS] -->``: ``popmesh launch -n N [OPTIONS] block.py``, e.g.
  ``-n 2``, ``-n 2 --engine mpi``, ``-n 2 --engine jax``;
* ``<!-- run: continue -->``: the block continues the page's previous block; the two (or more) run
  together as one script, the way the previous block runs;
* ``, alone`` after a way of running, e.g. ``<!-- run: popmesh launch -n 2, alone -->``: the block
  gets a process (a launch) of its own, for code that must own its process, such as a script that
  forms its world with ``torch.distributed`` itself.

Every process sees 8 simulated CPU JAX devices (``tests/conftest.py`` sets ``XLA_FLAGS``), works
in a fresh folder and gets ``POPMESH_TIMEOUT=60``. To keep the run short, all the blocks that run
the same way share one process (one launch; a torch-engine launch adds ``--preload torch,numpy``,
which starts the same ranks faster), page after page in order: each block runs from its own file as
``__main__`` in a fresh namespace, with ``sys.argv`` and ``sys.orig_argv`` as ``python block.py``
sets them (so ``fork()`` starts that block only). So a block under a launch leaves its world up
(no ``world.finalize()``) and nothing in flight for the next one. ``SystemExit(0)`` ends a block, not
the run. In a world of one each block's world is finalized after it, as its process's exit would.
A failure names its block (page and line); in a world of one the other blocks still run.

No block is exempt: a fragment continues an earlier block or is written out whole, and text that
is not Python to run (a signature listing, shell commands) goes in a ```` ```text ```` or
```` ```bash ```` block. Every fence names its language, so none can hold Python unseen.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import mpiexec

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<lang>[^`\s]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*run:\s*(?P<how>.*?)\s*-->\s*$")
NOT_PYTHON_NAMES = {"py", "python3", "pycon", "py3", "ipython"}  # Python that would not run: say ```python
DONE = "=== doc snippets done"
TIMEOUT_S = 240  # per way of running, all its blocks together


@dataclass
class Program:
    """One script: a block and the blocks that continue it."""

    page: Path
    line: int  # of the first block's fence
    how: str  # "python" or the `popmesh launch ...` command
    alone: bool = False  # in a process of its own
    source: str = ""
    lines: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"

    @property
    def file(self) -> str:
        return f"{self.page.relative_to(ROOT).with_suffix('').as_posix().replace('/', '_')}_{self.line}.py"


def parse(page: Path) -> tuple[list[Program], list[str]]:
    """The page's programs in order, and what is wrong with its fences and directives."""
    lines = page.read_text(encoding="utf-8").splitlines()
    programs: list[Program] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, ticks, lang = i, m["indent"], m["ticks"], m["lang"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            problems.append(f"{page.name}:{start + 1}: fence never closed")
            break
        i = end + 1
        where = f"{page.relative_to(ROOT)}:{start + 1}"
        if not lang:
            problems.append(f"{where}: a fence without a language (```text, ```bash, ```python, ...)")
            continue
        if lang in NOT_PYTHON_NAMES:
            problems.append(f"{where}: ```{lang}: write Python to run as ```python, anything else as ```text")
            continue
        if lang != "python":
            continue
        body = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                         for line in lines[start + 1:end]))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(before)
        how = directive["how"] if directive else "python"
        alone = how.endswith(", alone")
        how = how.removesuffix(", alone").strip() or "python"
        if how == "continue":
            if not programs:
                problems.append(f"{where}: `run: continue` on the page's first Python block")
                continue
            programs[-1].source += "\n" + body
            programs[-1].lines.append(start + 1)
        elif how == "python" or how.startswith("popmesh launch "):
            programs.append(Program(page, start + 1, how, alone, body, [start + 1]))
        else:
            problems.append(f"{where}: unknown directive `run: {how}` (see tests/world/test_doc_snippets.py)")
    return programs, problems


def _env() -> dict[str, str]:
    """The suite's environment without an enclosing world's variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE",
                        "PMI_RANK", "PMI_SIZE", "POPMESH_STORE_FD", "POPMESH_TRACE")}
    env.update(POPMESH_TIMEOUT="60", OMP_NUM_THREADS="1", MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
    return env


RUNNER = """\
import runpy, sys, traceback
failed = []
for path in {paths!r}:
    print("=== doc snippet " + path, flush=True)
    sys.argv, sys.orig_argv = [path], [sys.executable, path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except Exception:
        if not {keep_going!r}:  # a rank that goes on alone would meet its peers in other calls
            raise
        traceback.print_exc()
        failed.append(path)
        print("=== doc snippet failed: " + path, flush=True)
    if {keep_going!r} and "popmesh" in sys.modules:  # a world of one ends with its block, as at exit
        sys.modules["popmesh"].finalize()
if failed:
    sys.exit(1)
print({done!r}, flush=True)
"""


def _write(programs: list[Program], folder: Path) -> Path:
    """Each program in a file named after its page and line, and the runner that runs them in turn."""
    paths = []
    for p in programs:
        path = folder / p.file
        path.write_text(p.source, encoding="utf-8")
        paths.append(str(path))
    runner = folder / "runner.py"
    runner.write_text(RUNNER.format(paths=paths, done=DONE, keep_going=programs[0].how == "python"), encoding="utf-8")
    return runner


def _command(how: str, runner: Path) -> tuple[list[str], int]:
    """The command line of ``how`` running ``runner``, and its number of ranks."""
    if how == "python":
        return [sys.executable, str(runner)], 1
    args = shlex.split(how)[2:]
    if "mpi" in args and mpiexec() is None:
        pytest.skip(f"`{how}` needs mpiexec (pip install mpi4py mpich)")
    if not {"--engine", "--preload"} & set(args):  # torch ranks forked from one that imported torch once
        args += ["--preload", "torch,numpy"]
    return [sys.executable, "-m", "popmesh", "launch", *args, str(runner)], int(args[args.index("-n") + 1])


def _blocks_of(out: str, programs: list[Program]) -> str:
    """The blocks the output shows failing, or the last one started."""
    names = {p.file: p.name for p in programs}
    failed = re.findall(r"=== doc snippet failed: \S*/(\S+)", out)
    started = re.findall(r"=== doc snippet \S*/(\S+)", out)
    which = failed or started[-1:]
    return ", ".join(names.get(w, w) for w in which) or "(none started)"


def ways() -> dict[str, list[Program]]:
    """Every program of every page, by the way it runs (a program alone: its own), in page order."""
    by_how: dict[str, list[Program]] = {}
    for page in PAGES:
        for p in parse(page)[0]:
            by_how.setdefault(f"{p.how}, alone ({p.name})" if p.alone else p.how, []).append(p)
    return by_how


def test_every_fence_names_its_language_and_every_directive_is_known() -> None:
    problems = [problem for page in PAGES for problem in parse(page)[1]]
    assert not problems, "\n".join(problems)
    assert sum(len(programs) for programs in ways().values()) >= 20  # the finder finds the docs' blocks


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("way", list(ways()))
def test_blocks_run(way: str, tmp_path: Path) -> None:
    programs = ways()[way]
    how = programs[0].how
    cmd, ranks = _command(how, _write(programs, tmp_path))
    try:
        done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = "".join(x if isinstance(x, str) else x.decode(errors="replace") for x in (e.stdout or "", e.stderr or ""))
        pytest.fail(f"`{how}`: no end after {TIMEOUT_S} s in {_blocks_of(out, programs)}\n{out[-6000:]}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"`{how}` failed in {_blocks_of(out, programs)}:\n{out[-8000:]}"
    assert done.stdout.count(DONE) == ranks, f"`{how}`: not every rank ran every block:\n{out[-8000:]}"
