"""Several workers' checks in one world: the world-test files of one suite (``world_tests(...,
suite=...)``) share one world per engine and size instead of starting one each.

``POPMESH_TEST_SUITE`` names the worker modules, comma-separated, in the order their checks run.
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worldlib import main

if __name__ == "__main__":
    main([importlib.import_module(f"workers.{name}") for name in os.environ["POPMESH_TEST_SUITE"].split(",")])
