"""`popmesh launch`'s command line: torchrun's option names and values, mpirun's -np, logs, usage, --version."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest

import popmesh
from popmesh.core.errors import ConfigError
from popmesh.launch import cli
from popmesh.launch.api import launch
from popmesh.launch.logs import RankLogs, log_request, make_attempt_dir, parse_std, plan_routes
from popmesh.launch.options import (
    C10D_DEFAULT_PORT,
    REFUSED,
    launch_options,
    parse_endpoint,
    parse_rank_list,
    rendezvous,
)
from popmesh.launch.output import OutputPump
from popmesh.launch.plan import cpu_count

pytestmark = pytest.mark.timeout(30)


def parse(*argv: str) -> argparse.Namespace:
    """``popmesh launch ARGV x.py`` parsed (SystemExit on a parse error, like the CLI)."""
    return cli.build_parser().parse_args(["launch", *argv, "x.py"])


def options(*argv: str) -> dict:
    return launch_options(parse(*argv))[0]


@pytest.mark.parametrize(
    ("dashed", "underscored", "value", "field", "expected"),
    [
        ("--nproc-per-node", "--nproc_per_node", "3", "nproc", 3),
        ("--node-rank", "--node_rank", "1", "node_rank", 1),
        ("--master-addr", "--master_addr", "node0", "master_addr", "node0"),
        ("--master-port", "--master_port", "29501", "master_port", 29501),
        ("--rdzv-endpoint", "--rdzv_endpoint", "node0:29502", "master_port", 29502),
        ("--rdzv-id", "--rdzv_id", "job7", "run_id", "job7"),
        ("--log-dir", "--log_dir", "/tmp/logs", "log_dir", "/tmp/logs"),
        ("--max-restarts", "--max_restarts", "0", "max_restarts", 0),
        ("--local-ranks-filter", "--local_ranks_filter", "0,2", "local_ranks_filter", frozenset({0, 2})),
        ("--shutdown-timeout", "--shutdown_timeout", "7", "grace", 7.0),
    ],
)
def test_both_spellings_mean_the_same(dashed: str, underscored: str, value: str, field: str, expected) -> None:
    nodes = ["--nnodes", "2"] if field == "node_rank" else []
    assert options(*nodes, dashed, value)[field] == options(*nodes, underscored, value)[field] == expected
    assert options(*nodes, f"{underscored}={value}")[field] == expected


def test_nproc_aliases_and_values(capsys) -> None:
    assert options("-np", "4")["nproc"] == options("-n", "4")["nproc"] == 4
    assert options("-n", "cpu")["nproc"] == cpu_count()
    assert options()["nproc"] == 1
    for bad, words in (("gpu", "does not probe"), ("many", "not a number of ranks")):
        with pytest.raises(SystemExit):
            parse("-n", bad)
        err = capsys.readouterr().err
        assert "usage: popmesh launch" in err and "-n/-np/--nproc-per-node/--nproc_per_node" in err and words in err


def test_nnodes_takes_a_number_or_an_elastic_range(capsys) -> None:
    fixed = options("--nnodes", "2:2", "--master-port", "5")
    assert fixed["nnodes"] == 2 and fixed["max_nodes"] is None
    elastic = options("--nnodes", "1:3", "--rdzv-endpoint", "h:5", "--node-rank", "2")
    assert (elastic["nnodes"], elastic["max_nodes"], elastic["node_rank"]) == (1, 3, 2)
    for bad, words in (("3:1", "MIN is above MAX"), ("x", "not a number of nodes"), ("1:2:3", "not a number")):
        with pytest.raises(SystemExit):
            parse("--nnodes", bad)
        assert words in capsys.readouterr().err
    with pytest.raises(ConfigError, match="give each node its --node-rank"):
        options("--nnodes", "1:3", "--rdzv-endpoint", "h:5")


def test_an_elastic_range_is_checked_against_the_engine_and_the_node_rank() -> None:
    from popmesh.launch.plan import LaunchSpec, validate

    base = dict(nproc=2, nnodes=1, max_nodes=3, master_port=5)
    validate(LaunchSpec(**base, node_rank=2))
    with pytest.raises(ConfigError, match=r"outside 0\.\.2"):
        validate(LaunchSpec(**base, node_rank=3))
    with pytest.raises(ConfigError, match="only the torch engine"):
        validate(LaunchSpec(**base, engine="jax"))
    with pytest.raises(ConfigError, match="MIN < MAX"):
        validate(LaunchSpec(nproc=2, nnodes=3, max_nodes=2, master_port=5))


def test_a_joining_node_s_ranks_are_told_to_join_and_numbered_past_the_first_world() -> None:
    from popmesh.launch.plan import LaunchSpec, plan_ranks

    first = plan_ranks(LaunchSpec(nproc=2, nnodes=1, max_nodes=3, master_port=5), 5, "/e")
    assert [p.env["RANK"] for p in first] == ["0", "1"] and first[0].env["WORLD_SIZE"] == "2"
    assert first[0].env["POPMESH_MIN_NODES"] == "1" and "POPMESH_JOIN" not in first[0].env
    assert first[0].env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # node 0's launcher serves the store
    later = plan_ranks(LaunchSpec(nproc=2, nnodes=1, max_nodes=3, master_port=5, node_rank=2), 5, "/e")
    assert [p.env["RANK"] for p in later] == ["4", "5"] and later[0].env["WORLD_SIZE"] == "6"
    assert later[1].env["POPMESH_JOIN"] == "1"


@pytest.mark.parametrize(
    ("endpoint", "backend", "expected"),
    [
        ("node0:29500", "static", ("node0", 29500)),
        (" 10.0.0.1:0 ", "static", ("10.0.0.1", 0)),
        ("[::1]:1234", "static", ("::1", 1234)),
        ("node0", "c10d", ("node0", C10D_DEFAULT_PORT)),
        ("[fe80::1]", "c10d", ("fe80::1", C10D_DEFAULT_PORT)),
    ],
)
def test_rdzv_endpoint_is_host_and_port(endpoint: str, backend: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint, backend) == expected


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("node0", "has no port"),
        ("::1:5", "in brackets"),
        ("[::1", "[ADDR]:PORT"),
        ("[::1]5", "[ADDR]:PORT"),
        (":5", "names no host"),
        ("node0:http", "number from 0 to 65535"),
        ("node0:70000", "number from 0 to 65535"),
    ],
)
def test_bad_rdzv_endpoints_say_what_to_write(endpoint: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        parse_endpoint(endpoint)


def test_rendezvous_from_endpoint_master_options_and_standalone() -> None:
    got = options("--rdzv-endpoint", "node0:29500", "--nnodes", "2", "--node-rank", "1")
    assert (got["master_addr"], got["master_port"], got["nnodes"], got["node_rank"]) == ("node0", 29500, 2, 1)
    assert options("--rdzv-endpoint", "node0:29500", "--master-port", "29500")["master_port"] == 29500
    with pytest.raises(ConfigError, match="--master-port 1 disagrees with --rdzv-endpoint"):
        options("--rdzv-endpoint", "node0:29500", "--master-port", "1")
    assert options("--master-addr", "[::1]")["master_addr"] == "::1"
    plain = options()
    assert (plain["master_addr"], plain["master_port"], plain["run_id"]) == ("127.0.0.1", 0, None)
    rdzv, warnings = rendezvous(parse("--standalone", "--nnodes", "1"))
    assert (rdzv.master_addr, rdzv.master_port, rdzv.nnodes, rdzv.run_id, warnings) == ("127.0.0.1", 0, 1, None, [])
    rdzv, warnings = rendezvous(parse("--standalone", "--master-port", "29500", "--rdzv-id", "x"))
    assert rdzv.master_port == 0 and rdzv.run_id is None
    assert warnings == ["--standalone picks a free port on loopback and a new run id, so --master-port 29500, "
                        "--rdzv-id x are ignored (as torchrun does); drop them"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--standalone", "--nnodes", "2"], "--standalone is one node"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not supported"),
        (["--rdzv_backend", "c10d", "--nnodes", "2", "--master-port", "5"], "give each node its --node-rank"),
        (["--rdzv-conf", "join_timeout=900"], "--rdzv-conf 'join_timeout=900'"),
        (["--event-log-handler", "console"], "--event-log-handler 'console'"),
        (["--run-path", "-m"], "--run-path runs a script"),
        (["--monitor-interval", "0"], "--monitor-interval 0.0 must be > 0"),
        (["--local-ranks-filter", "a,b"], "--local-ranks-filter 'a,b'"),
    ],
)
def test_inapplicable_settings_are_refused_by_name(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        options(*argv)


def test_accepted_torchrun_options_that_change_nothing() -> None:
    base = options()
    for argv in (["--rdzv-backend", "c10d"], ["--monitor-interval", "5"], ["--start-method", "fork"],
                 ["--run_path"], ["--rdzv-conf", ""], ["--event_log_handler", "null"]):
        assert options(*argv) == base
    assert options("--role", "trainer")["role"] == "trainer"
    assert options("-t", "3", "-r", "0:1,1:2")["tee"] == "3"
    assert options("--tee", "1")["tee"] == "1" and options("--redirects", "2")["redirects"] == "2"
    assert parse_rank_list(None) is None and parse_rank_list("1, 0") == frozenset({0, 1})


@pytest.mark.parametrize(("names", "takes_value", "reason"), REFUSED)
def test_refused_torchrun_options_name_themselves(names: tuple[str, ...], takes_value: bool, reason: str,
                                                  capsys) -> None:
    for name in names:
        with pytest.raises(SystemExit) as exited:
            parse(name, *(["v"] if takes_value else []))
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "usage: popmesh launch" in err
        assert f"argument {'/'.join(names)}: torchrun's option is not supported: {reason}" in err


def test_max_restarts_where_no_engine_can_take_a_rank_back_is_a_clear_error(tmp_path: Path, capsys) -> None:
    """jax.distributed cannot take a process back (MPI restarts its whole job: test_mpi_job_restart.py)."""
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert cli.main(["launch", "--max-restarts", "1", "--engine", "jax", "-n", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("popmesh launch: error: --max-restarts 1 with --engine jax: jax.distributed cannot take")
    with pytest.raises(ConfigError, match=r"jax\.distributed cannot take a restarted process"):
        launch(str(script), max_restarts=3, engine="jax")
    with pytest.raises(ConfigError, match="give 0"):
        launch(str(script), max_restarts=-1)


def test_unknown_options_get_the_commands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", "--bogus", "-n", "2", "x.py", "--lr", "1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: popmesh launch ") and "popmesh launch: error: unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        cli.main(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: popmesh [-h]")


def test_version(capsys) -> None:
    for argv in (["--version"], ["launch", "--version"], ["launch", "-n", "2", "--version"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 0 and capsys.readouterr().out == f"popmesh {popmesh.__version__}\n"
    out = subprocess.run([sys.executable, "-m", "popmesh", "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == f"popmesh {popmesh.__version__}\n"


def test_tee_and_redirect_values() -> None:
    assert parse_std(None, "--tee") == 0 and parse_std("3", "--tee") == 3 and parse_std(2, "--tee") == 2
    assert parse_std("0:3, 1:2,12:1", "--tee") == {0: 3, 1: 2, 12: 1}
    assert parse_std({1: 1}, "--tee") == {1: 1}
    for bad in ("4", "-1", "x", "0:4", "0:1,", "1=2", 5, {0: 7}, {-1: 1}):
        with pytest.raises(ConfigError, match=r"--redirects .* is not one of torchrun's values"):
            parse_std(bad, "--redirects")  # type: ignore[arg-type]


def test_routes_follow_torchrun() -> None:
    ranks = [(4, 0), (5, 1), (6, 2)]  # node rank 2 of a 3-rank-per-node world
    routes = plan_routes(log_request("/l", tee="0:1", redirects="1:3,2:2"), "/a", ranks)
    assert routes[4].files == {"stdout": "/a/0/stdout.log"} and routes[4].console == {"stdout", "stderr"}
    assert routes[5].files == {"stdout": "/a/1/stdout.log", "stderr": "/a/1/stderr.log"} and not routes[5].console
    assert routes[6].files == {"stderr": "/a/2/stderr.log"} and routes[6].console == {"stdout"}
    assert {r.directory for r in routes.values()} == {"/a/0", "/a/1", "/a/2"}
    teed = plan_routes(log_request("/l"), "/a", ranks)  # --log-dir alone tees both streams
    assert all(len(r.files) == 2 and r.console == {"stdout", "stderr"} for r in teed.values())
    assert log_request("/l", tee=0).tee == 0 and not log_request("/l", redirects="0").redirects
    filtered = plan_routes(log_request(tee=3, local_ranks_filter=[1]), "/a", ranks)
    assert [bool(filtered[r].console) for r in (4, 5, 6)] == [False, True, False]
    assert all(len(r.files) == 2 for r in filtered.values())
    console_only = plan_routes(log_request(local_ranks_filter={0}), None, ranks)
    assert console_only[4].console == {"stdout", "stderr"} and not console_only[5].console
    assert not any(r.files or r.directory for r in console_only.values())
    assert not log_request().routes_output and log_request(local_ranks_filter=[0]).routes_output
    assert not log_request(local_ranks_filter=[0]).writes_files and log_request(redirects=1).writes_files
    for bad in ([], [-1]):
        with pytest.raises(ConfigError, match="--local-ranks-filter"):
            log_request(local_ranks_filter=bad)
    with pytest.raises(ConfigError, match="--log-dir is empty"):
        log_request(" ")


def test_rank_logs_write_files_and_hide_redirected_lines(tmp_path: Path) -> None:
    attempt = make_attempt_dir(str(tmp_path / "logs"), "job/7")
    assert Path(attempt).name == "attempt_0" and Path(attempt).parent.name.startswith("job_7_")
    logs = RankLogs(plan_routes(log_request(str(tmp_path), redirects="0:1", tee="1:2"), attempt, [(0, 0), (1, 1)]))
    out, err = io.StringIO(), io.StringIO()
    pump = OutputPump(out, err, sink=logs)
    pump.attach(io.BytesIO(b"out 0\nlast 0"), "stdout", 0)
    pump.attach(io.BytesIO(b"err 0\n"), "stderr", 0)
    pump.attach(io.BytesIO(b"out 1\n"), "stdout", 1)
    pump.attach(io.BytesIO(b"err 1\n"), "stderr", 1)
    pump.join()
    logs.close()
    logs.write(0, "stdout", b"after close is dropped\n")
    assert (Path(attempt) / "0" / "stdout.log").read_bytes() == b"out 0\nlast 0"
    assert (Path(attempt) / "1" / "stderr.log").read_text() == "err 1\n"
    assert sorted(p.name for p in Path(attempt).glob("*/*")) == ["stderr.log", "stdout.log"]
    assert out.getvalue() == "[rank 1] out 1\n" and sorted(err.getvalue().splitlines()) == ["[rank 0] err 0",
                                                                                             "[rank 1] err 1"]
    assert pump.tail(0, "stdout") == ["out 0", "last 0"]  # kept for the failure summary even when not shown
    error_dir = tmp_path / "errors"
    error_dir.mkdir()
    (error_dir / "rank-1.json").write_text("{}")
    logs.keep_errors(str(error_dir))
    assert (Path(attempt) / "1" / "error.json").read_text() == "{}"
    assert not (Path(attempt) / "0" / "error.json").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a directory"):
        make_attempt_dir(str(tmp_path / "file"), "x")


def test_rank0_terminal_cannot_also_be_logged(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="rank0_terminal"):
        launch(str(script), rank0_terminal=True, log_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["s.py"]  # refused before any log folder was made


def test_script_options_after_the_script_pass_through_even_as_prefixes_of_launcher_options() -> None:
    ns = cli.build_parser().parse_args(["launch", "-n", "2", "train.py", "--run", "3", "--nproc", "x", "-n", "5"])
    assert ns.nproc == 2 and ns.args == ["--run", "3", "--nproc", "x", "-n", "5"]


def test_the_version_is_the_package_metadata_version():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert popmesh.__version__ == pyproject["project"]["version"]
