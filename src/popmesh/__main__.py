"""``python -m popmesh ...``: the same command line as the ``popmesh`` script."""

import sys

from popmesh.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
