"""fork(2) from a script or from ``python -m launch_fork``: ranks print, the parent reports."""

import os
import sys

from popmesh.launch import fork

if fork(2, grace=1.0):
    print(f"PARENT done args={sys.argv[1:]}")
    sys.exit(0)
rank = os.environ.get("RANK", "none")
print(f"CHILD rank={rank} args={sys.argv[1:]}")
if "fail" in sys.argv[1:] and rank == "1":
    raise RuntimeError("fork child failure")
