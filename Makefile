# Two commands: `make demo` and `make test` (which runs `make lint` and `make docs` first). Each creates .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.popmesh-installed
TORCHGFN := torchgfn==2.4.1

.PHONY: demo lint test test-fast bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 lies on disk here; any other version downloads gigabytes.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[mpi,jax,demo,pb2,docs,dev,package,gfn]" torch==2.13.0
	# torchgfn pins numpy<2, which popmesh (numpy 2) cannot honour, and runs on numpy 2: it goes in without its
	# dependencies, which the gfn extra above brought (torch stays at 2.13.0).
	$(BIN)/python -m pip install --quiet --no-deps $(TORCHGFN)
	touch $(STAMP)

# Every rank process imports popmesh: compile it once here, since an import writes no .pyc where
# PYTHONDONTWRITEBYTECODE is set (a fresh clone then compiled it in each of the suite's processes).
COMPILE := $(BIN)/python -m compileall -q src tests examples benchmarks
# The MPI engine's C parts (src/popmesh/engines/mpi/_native.c, _reduce.c), built in place for this CPU with
# zig's compiler from PyPI; a no-op when they are up to date, and the Python path runs where they cannot
# be built. (The package build, setup.py, compiles them into the wheel the same way.)
NATIVE  := $(BIN)/python -m popmesh.engines.mpi.build_native

demo: $(STAMP)
	$(NATIVE)
	$(COMPILE)
	$(BIN)/popmesh demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples setup.py
	$(BIN)/mypy

test: lint docs
	$(NATIVE)
	$(COMPILE)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: $(STAMP)
	$(NATIVE)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

bench: $(STAMP)
	$(NATIVE)
	$(BIN)/python benchmarks/collectives.py

# The docs site (mkdocs.yml) into site/; --strict fails on any warning: a broken link or anchor, a
# page missing from the nav, a reference that does not resolve.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The package as users get it: sdist and wheel built, twine-checked, installed into fresh venvs outside
# the checkout and run as 2-rank MPI and torch worlds (tests/package/check.sh; CI runs it after the tests).
package-check: $(STAMP)
	bash tests/package/check.sh

clean:
	rm -rf $(VENV) .pytest_cache build dist site *.egg-info src/*.egg-info src/popmesh/engines/mpi/_*.so \
		src/popmesh/engines/mpi/_*.so.inputs src/popmesh/engines/mpi/build_report.txt
