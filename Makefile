# Two commands: `make demo` and `make test` (which runs `make lint` first). Each creates .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.popmesh-installed

.PHONY: demo lint test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 lies on disk here; any other version downloads gigabytes.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[mpi,jax,demo,dev]"
	touch $(STAMP)

# Every rank process imports popmesh: compile it once here, since an import writes no .pyc where
# PYTHONDONTWRITEBYTECODE is set (a fresh clone then compiled it in each of the suite's processes).
COMPILE := $(BIN)/python -m compileall -q src tests examples benchmarks
# The MPI engine's C parts (src/popmesh/engines/mpi/_native.c, _reduce.c), built with zig's compiler from
# PyPI; a no-op when they are up to date, and the Python path runs where they cannot be built.
NATIVE  := $(BIN)/python -m popmesh.engines.mpi.build_native

demo: $(STAMP)
	$(NATIVE)
	$(COMPILE)
	$(BIN)/popmesh demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

test: lint
	$(NATIVE)
	$(COMPILE)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: $(STAMP)
	$(NATIVE)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

bench: $(STAMP)
	$(NATIVE)
	$(BIN)/python benchmarks/collectives.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info src/popmesh/engines/mpi/_*.so src/popmesh/engines/mpi/_*.so.inputs
