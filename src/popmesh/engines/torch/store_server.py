"""The rendezvous store of a world whose ranks may be restarted, in a process of its own.

Normally rank 0 serves torch's TCPStore, so the store dies with rank 0 and a world that lost rank 0
could never form again. With ``popmesh launch --max-restarts N`` node 0's launcher starts this
process instead (as torchrun's agent serves the store); every rank connects as a client
(``TORCHELASTIC_USE_AGENT_STORE=True``). The launcher imports no engine; this module is run as
``python -m popmesh.engines.torch.store_server FD ADDR PORT WORLD_SIZE`` on the socket the launcher
bound, and serves until SIGTERM (the launcher's teardown, or its death through the parent-death leash).
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

__all__ = ["serve"]

_USAGE = "usage: python -m popmesh.engines.torch.store_server LISTEN_FD ADDR PORT WORLD_SIZE"


def serve(fd: int, addr: str, port: int, world_size: int) -> None:
    """Serve the store on the listening socket ``fd`` until SIGTERM or SIGINT."""
    dist: Any = importlib.import_module("torch.distributed")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = dist.TCPStore(addr, port, world_size, True, timedelta(days=1), wait_for_workers=False,
                          multi_tenant=True, master_listen_fd=fd)
    while not stop.wait(1.0):
        pass
    del store


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or not all(a.isdigit() for a in (args[0], args[2], args[3])):
        sys.exit(_USAGE)
    serve(int(args[0]), args[1], int(args[2]), int(args[3]))


if __name__ == "__main__":
    main()
