"""Package surface: importing popmesh starts no JAX; popmesh.jax exports what it lists."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import popmesh.jax as pj

SRC = pathlib.Path(pj.__file__).parent
BANNED = (
    "jax._src", "jax.experimental.shard_map", "device_put_sharded", "device_put_replicated", "global_state",
)


def test_importing_popmesh_does_not_import_jax():
    code = "import sys, popmesh, popmesh.core.errors; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_all_names_resolve_and_are_unique():
    assert len(set(pj.__all__)) == len(pj.__all__)
    for name in pj.__all__:
        assert getattr(pj, name) is not None, name


def test_only_public_jax_apis_are_used():
    for path in SRC.glob("*.py"):
        text = path.read_text()
        for banned in BANNED:
            assert banned not in text, f"{path.name} uses {banned}"
