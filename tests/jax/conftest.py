"""8 simulated CPU devices for the JAX tests.

XLA reads ``XLA_FLAGS`` when its CPU backend starts (the first ``jax.devices()``), so setting it
here works as long as nothing touched a backend before this conftest was imported. If something
did, and fewer than 8 devices exist, the tests here are skipped with the reason instead of failing.
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
N_DEVICES = 8

if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={N_DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util

import pytest

if any(importlib.util.find_spec(name) is None for name in ("jax", "flax", "optax")):
    collect_ignore_glob = ["test_*.py"]  # the popmesh[jax] extra is not installed


@pytest.fixture(autouse=True, scope="session")
def _eight_devices() -> None:
    import jax

    count = jax.device_count()
    if count < N_DEVICES:
        pytest.skip(
            f"need {N_DEVICES} JAX devices, found {count}: the JAX backend started before "
            f"tests/jax/conftest.py could set XLA_FLAGS={_DEVICE_FLAG}={N_DEVICES}; set it in the "
            "environment or in tests/conftest.py"
        )


@pytest.fixture(scope="session")
def devices() -> list:
    import jax

    return jax.devices()[:N_DEVICES]


@pytest.fixture(scope="session")
def dp_mesh(devices: list):
    """1-D mesh of the 8 devices along ``"DP"``."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices), ("DP",))


@pytest.fixture(scope="session")
def grid_mesh(devices: list):
    """2-D mesh ``("POP", "DP") = (2, 4)``."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices).reshape(2, 4), ("POP", "DP"))
