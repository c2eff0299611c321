"""One rank's ``popmesh.init()`` on torch, timed (torch imported first, so only forming the world
counts); prints {"formed": bool, "error", "message", "missing", "seconds"} as JSON."""

import json
import time

import torch.distributed  # noqa: F401 - imported before the clock starts

import popmesh

start = time.monotonic()
try:
    popmesh.init()
    outcome = {"formed": True}
except Exception as e:
    outcome = {"formed": False, "error": type(e).__name__, "message": str(e),
               "missing": list(getattr(e, "missing", None) or [])}
outcome["seconds"] = round(time.monotonic() - start, 3)
print(json.dumps(outcome), flush=True)
