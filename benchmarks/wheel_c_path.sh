#!/usr/bin/env bash
# The MPI C path as the wheel installs it (compiled for a portable CPU, -mcpu=baseline) against the one
# `make` builds in place (-mcpu=native): benchmarks/messages.py mpi run by each in turn, ROUNDS times.
# Goal: the wheel's 4 B round trip within 5 % of make's. Run: bash benchmarks/wheel_c_path.sh [ROUNDS]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ROUNDS="${1:-2}"
WORK="$(mktemp -d /tmp/popmesh-wheel-bench.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
"$ROOT/.venv/bin/python" -m build --wheel --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet torch==2.13.0 "$(ls "$WORK"/dist/*.whl)[mpi,torch]"
cp -r "$ROOT/benchmarks" "$WORK/benchmarks"  # outside the checkout, so popmesh is the wheel's
for round in $(seq "$ROUNDS"); do
  for who in make wheel; do
    if [ "$who" = make ]; then py="$ROOT/.venv/bin/python"; else py="$WORK/venv/bin/python"; fi
    (cd "$WORK" && "$py" benchmarks/messages.py mpi) | grep -E '^mpich +4 B' | sed "s/^/$who  round $round  /"
  done
done
