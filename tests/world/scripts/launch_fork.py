"""fork(2) from a script or from ``python -m launch_fork``: ranks print, the parent reports."""

import os
import sys
import time

from popmesh.launch import fork

if fork(2, grace=1.0):
    print(f"PARENT done args={sys.argv[1:]}")
    sys.exit(0)
rank = os.environ.get("RANK", "none")
print(f"CHILD rank={rank} args={sys.argv[1:]}")
if "fail" in sys.argv[1:] and rank == "1":
    time.sleep(1.0)  # let rank 0 print first: the launcher stops the other ranks once one fails
    raise RuntimeError("fork child failure")
