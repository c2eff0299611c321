"""What several world-test scripts share (each script's folder is first on its sys.path)."""

import os


def resident_bytes() -> int:
    """This process's resident set, in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
