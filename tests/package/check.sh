#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel, check their metadata, install the wheel
# into a fresh venv outside the checkout and run 2-rank MPI (C path required) and torch worlds from it;
# then install the sdist where no compiler is available and check that the Python path runs and that
# `popmesh info` says why the C path is not built. Run by `make package-check` (and CI).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILDER="$ROOT/.venv/bin/python"
DIST="$ROOT/dist"
WORK="$(mktemp -d /tmp/popmesh-package.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
say() { printf 'package-check: %s\n' "$*"; }
launch() { (cd "$WORK" && timeout 180 "$@"); }

say "building the sdist and the wheel (isolated build environments)"
rm -rf "$DIST"
"$BUILDER" -m build --outdir "$DIST" "$ROOT" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$DIST"/popmesh-*.whl)"
SDIST="$(ls "$DIST"/popmesh-*.tar.gz)"
case "$WHEEL" in *-none-any.whl) say "the wheel is pure: the C parts were not compiled"; exit 1;; esac
"$BUILDER" -m twine check --strict "$WHEEL" "$SDIST"

say "installing $(basename "$WHEEL") into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install --quiet --upgrade pip
"$V/python" -m pip install --quiet torch==2.13.0  # the CPU build on disk; any other version downloads gigabytes
"$V/python" -m pip install --quiet "$WHEEL[mpi,torch]"
cp "$ROOT/tests/package/smoke_world.py" "$WORK/"
launch "$V/popmesh" info | tee "$WORK/info.txt" | grep "MPI C path"
grep -q "MPI C path: ready" "$WORK/info.txt"
launch env SMOKE_INSTALLED=1 POPMESH_MPI_NATIVE=1 SMOKE_EXPECT_C_PATH="in use" \
  "$V/popmesh" launch --engine mpi -n 2 smoke_world.py
launch env SMOKE_INSTALLED=1 "$V/popmesh" launch -n 2 smoke_world.py

say "installing $(basename "$SDIST") with no compiler available"
"$PYTHON" -m venv "$WORK/bare"
B="$WORK/bare/bin"
"$B/python" -m pip install --quiet --upgrade pip
"$B/python" -m pip install --quiet "setuptools>=77" "numpy>=2.4.6" "mpi4py>=4.1.2" "mpich>=5.0.2"
"$B/python" -m pip install --no-build-isolation --verbose "$SDIST" > "$WORK/bare.log" 2>&1 || { tail -40 "$WORK/bare.log"; exit 1; }
grep -m1 "zig compiler is not installed" "$WORK/bare.log"
launch "$B/popmesh" info | tee "$WORK/bare-info.txt" | grep "MPI C path"
grep -q "MPI C path: not built (no compiled _native here (the package build said: the zig compiler is not installed" "$WORK/bare-info.txt"
launch env SMOKE_INSTALLED=1 SMOKE_EXPECT_C_PATH="not built" "$B/popmesh" launch --engine mpi -n 2 smoke_world.py
say "ok"
