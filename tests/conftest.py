"""Test-wide setup: JAX sees 8 simulated CPU devices, set before anything imports jax."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The slowest files, longest first (measured with --durations): `make test` runs two pytest-xdist
# workers a file at a time, and a long file left for the end would run alone on an idle core.
_SLOWEST_FIRST = ("test_demo.py", "test_survival.py", "test_messages.py", "test_failures.py", "test_collectives.py",
                  "test_wide.py", "test_hosts.py", "test_launcher.py", "test_buffers.py")


def pytest_collection_modifyitems(items):
    """Run the slowest files first; every other test keeps its place (a stable sort)."""
    place = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(_SLOWEST_FIRST)))
