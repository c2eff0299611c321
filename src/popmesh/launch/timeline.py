"""``popmesh launch --trace DIR``: the ranks record into DIR, the launcher merges their files at the end.

The ranks' ``popmesh.init()`` reads ``POPMESH_TRACE`` and starts recording; told that the launcher
merges (``POPMESH_TRACE_MERGED_BY=launcher``), they only write ``DIR/rank-R.trace.json`` at finalize.
Once the world has exited, however it ended, the launcher joins the files that are there into
``DIR/trace.json``, so a rank that died leaves the others' timelines readable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from popmesh.comm.tracing import LAUNCHER_MERGES_ENV
from popmesh.core.trace import TRACE_ENV, merge_traces, trace_folder

__all__ = ["trace_env", "merge_after_exit"]


def trace_env(directory: str) -> dict[str, str]:
    """The ranks' variables that make them trace into ``directory`` (created here, made absolute)."""
    return {TRACE_ENV: str(trace_folder(Path(directory).resolve())), LAUNCHER_MERGES_ENV: "launcher"}


def merge_after_exit(directory: str, err: TextIO) -> Path | None:
    """Merge the ranks' files and say where the trace is (or that no rank left one) on ``err``."""
    try:
        path = merge_traces(Path(directory).resolve())
    except OSError as e:
        err.write(f"popmesh launch: could not merge the trace in {directory}: {e}\n")
        return None
    if path is None:
        err.write(f"popmesh launch: no rank left a trace in {directory} (did the script call popmesh.init()?)\n")
    else:
        err.write(f"popmesh launch: trace in {os.path.relpath(path)}: open it in https://ui.perfetto.dev "
                  "or chrome://tracing\n")
    err.flush()
    return path
