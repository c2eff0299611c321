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


def open_mpi():
    return SimpleNamespace(Get_library_version=lambda: "Open MPI v5.0.8, package: Open MPI\n...",
                           Is_initialized=lambda: True)


def test_the_status_is_off_when_switched_off(monkeypatch):
    monkeypatch.setenv("POPMESH_MPI_NATIVE", "0")
    assert native.native_status(object()) == ("off", "POPMESH_MPI_NATIVE=0 chooses the Python path")


def test_the_status_refuses_another_mpi_with_its_name(monkeypatch):
    monkeypatch.delenv("POPMESH_MPI_NATIVE", raising=False)
    state, reason = native.native_status(open_mpi())
    assert state == "refused" and "this MPI is 'Open MPI v5.0.8" in reason


def test_the_status_refuses_an_mpi_started_without_thread_multiple(monkeypatch):
    monkeypatch.delenv("POPMESH_MPI_NATIVE", raising=False)
    mpi = single_threaded_mpi()
    mpi.Is_initialized = lambda: True
    assert native.native_status(mpi) == ("refused", "MPI was not initialised with MPI_THREAD_MULTIPLE "
                                                    "(its receive spins with the GIL released)")


def test_the_status_is_ready_before_mpi_starts(monkeypatch):
    monkeypatch.delenv("POPMESH_MPI_NATIVE", raising=False)
    mpi = single_threaded_mpi()
    mpi.Is_initialized = lambda: False  # Query_thread is not asked before MPI_Init
    mpi.Query_thread = None
    assert native.native_status(mpi).state == "ready"


def test_the_build_report_names_why_a_part_was_left_out(monkeypatch, tmp_path):
    (tmp_path / "build_report.txt").write_text("_native: not built at install time: no zig here\n"
                                               "_reduce: built for -mcpu=baseline\n")
    monkeypatch.setattr(native, "__file__", str(tmp_path / "native.py"))
    assert native._build_report("_native") == "no zig here"
    assert native._build_report("_reduce") == ""


def test_the_package_build_and_make_share_one_plan():
    """setup.py compiles for a portable CPU with a run path relative to the installed module; make for
    this CPU with the path where MPICH's library is now."""
    wheel = build_native.plan("_native", cpu="baseline", runpath=build_native.INSTALLED_RUNPATH)
    here = build_native.plan("_native")
    assert not isinstance(wheel, str) and not isinstance(here, str)
    assert "-mcpu=baseline" in wheel.command and "-mcpu=native" in here.command
    assert "-Wl,-rpath,$ORIGIN/../../../../.." in wheel.command
    _header, library = build_native.mpich_files()
    assert f"-Wl,-rpath,{library.parent}" in here.command and wheel.fingerprint != here.fingerprint
