"""The MPI C path's setting, its loader's refusals and its build (the C path itself runs in
tests/world/test_mpi_native.py, on a real MPI world)."""

import re
from types import SimpleNamespace

import pytest

from popmesh.core.errors import ConfigError
from popmesh.engines.mpi import build_native, native


@pytest.mark.parametrize("raw, setting", [("", "auto"), ("auto", "auto"), ("0", "off"), (" OFF ", "off"),
                                          ("1", "on"), ("on", "on")])
def test_the_setting_reads_auto_off_and_on(raw, setting):
    assert native.native_setting({"POPMESH_MPI_NATIVE": raw}) == setting


def test_an_unknown_setting_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"POPMESH_MPI_NATIVE='yes'.*1.*0.*auto"):
        native.native_setting({"POPMESH_MPI_NATIVE": "yes"})


def test_off_never_loads_it(monkeypatch):
    monkeypatch.setenv("POPMESH_MPI_NATIVE", "0")
    assert native.load_native(object()) is None  # not even asked about MPI


def single_threaded_mpi():
    return SimpleNamespace(Query_thread=lambda: 0, THREAD_MULTIPLE=3, Get_library_version=lambda: "MPICH Version: 5")


def test_another_mpi_is_refused_before_the_extension_is_loaded(monkeypatch):
    monkeypatch.setenv("POPMESH_MPI_NATIVE", "1")
    open_mpi = SimpleNamespace(Get_library_version=lambda: "Open MPI v5.0.8, package: Open MPI\n...")
    with pytest.raises(ConfigError, match=re.escape("MPICH wheel, and this MPI is 'Open MPI v5.0.8")):
        native.load_native(open_mpi)


def test_required_where_it_cannot_be_used_says_why(monkeypatch):
    monkeypatch.setenv("POPMESH_MPI_NATIVE", "1")
    with pytest.raises(ConfigError, match=r"MPI_THREAD_MULTIPLE.*build_native"):
        native.load_native(single_threaded_mpi())


def test_auto_falls_back_to_the_python_path_where_it_cannot_be_used(monkeypatch):
    monkeypatch.delenv("POPMESH_MPI_NATIVE", raising=False)
    assert native.load_native(single_threaded_mpi()) is None


def test_make_built_it_and_a_second_build_does_nothing():
    """`make test` builds the C path before the tests: it is there and up to date."""
    assert "up to date" in build_native.build(), "run `python -m popmesh.engines.mpi.build_native` (make does)"
    assert all(build_native._target(name).is_file() for name in build_native.EXTENSIONS)
