"""Marks in a running world's rendezvous store, for the launcher (which imports no engine).

``python -m popmesh.engines.torch.store_client ADDR PORT`` reads commands from its standard input, one
a line, and answers each on its standard output:

* ``left SLOT``: the launcher's rank ``SLOT`` is lost for good (``popmesh launch --nnodes MIN:MAX`` had no
  restart left for it), so the world's next generation forms without it
  (:mod:`popmesh.engines.torch.generations`). Answered ``ok SLOT``, or ``error SLOT WHY``.

An elastic launcher starts it with its ranks, so that torch is imported and the store connected before
a rank is lost: the mark then reaches the survivors within milliseconds of the loss, not after another
interpreter's start. It connects at its first command (the store may not serve yet when it starts),
gives up on one after ``POPMESH_TIMEOUT`` seconds (30 by default), and ends at the end of its input.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta
from typing import Any, TextIO

from popmesh.engines.torch.generations import mark_left

__all__ = ["serve_marks"]

_USAGE = "usage: python -m popmesh.engines.torch.store_client ADDR PORT  (commands on stdin: left SLOT)"


def serve_marks(addr: str, port: int, timeout: float, commands: TextIO, answers: TextIO) -> None:
    """Carry out ``commands`` (lines) against the store at ``addr:port`` until they end."""
    dist: Any = importlib.import_module("torch.distributed")
    store = None
    for line in commands:
        words = line.split()
        if len(words) != 2 or words[0] != "left" or not words[1].isdigit():
            answers.write(f"error ? not a command: {line.strip()!r}\n")
            answers.flush()
            continue
        try:
            if store is None:
                store = dist.TCPStore(addr, port, 1, False, timedelta(seconds=timeout), wait_for_workers=False)
            mark_left(store, int(words[1]))
            answers.write(f"ok {words[1]}\n")
        except Exception as e:  # the store is gone (the world ended) or never answered: say so, carry on
            store = None
            answers.write(f"error {words[1]} {' '.join(str(e).split())[:300]}\n")
        answers.flush()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        sys.exit(_USAGE)
    serve_marks(args[0], int(args[1]), float(os.environ.get("POPMESH_TIMEOUT") or 30), sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
