"""Pure parts of running past one host: interface choice, host lists, the MPI command, the plan's checks."""

import pytest

from popmesh.core.errors import ConfigError
from popmesh.core.interfaces import Interface, choose_interface, interface_address, is_loopback, list_interfaces
from popmesh.core.launch_env import TorchEnv
from popmesh.engines.torch.network import pin_interface, spans_hosts
from popmesh.launch.hosts import hydra_hosts, parse_hostfile, parse_hosts, ranks_on
from popmesh.launch.mpirun import mpi_command
from popmesh.launch.plan import LaunchSpec, loopback_env, validate

LO = Interface("lo", True, True, ("127.0.0.1", "::1"))
ETH = Interface("eth0", True, False, ("10.1.2.3",))
IB = Interface("ib0", True, False, ("192.168.7.5",))
DOWN = Interface("eth1", False, False, ("172.16.0.9",))


def _env(master: str, size: int = 4, local: int | None = 2) -> TorchEnv:
    return TorchEnv(rank=0, world_size=size, local_rank=0, local_world_size=local, master_addr=master,
                    master_port=29500, store_fd=None)


@pytest.mark.parametrize("addr,loop", [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("localhost", True),
                                       ("10.0.0.1", False), ("node0", False), ("fe80::1%eth0", False)])
def test_loopback_addresses_are_told_apart(addr, loop):
    assert is_loopback(addr) is loop


def test_the_interface_holding_the_route_source_is_chosen():
    choice = choose_interface("node0", "192.168.7.5", [LO, ETH, IB, DOWN])
    assert (choice.name, choice.address) == ("ib0", "192.168.7.5") and "route to node0" in choice.reason


def test_a_loopback_route_falls_back_to_the_only_outside_interface_that_is_up():
    """The rendezvous host whose own name resolves to 127.0.1.1 locally."""
    choice = choose_interface("node0", "127.0.1.1", [LO, ETH, DOWN])
    assert choice.name == "eth0" and "route to it is loopback" in choice.reason
    assert choose_interface("node0", None, [LO, ETH]).name == "eth0"


def test_several_candidates_leave_the_choice_to_the_user():
    assert choose_interface("node0", "127.0.1.1", [LO, ETH, IB]) is None
    assert choose_interface("node0", "10.9.9.9", [LO, ETH, IB]) is None  # a source no interface holds, two candidates


def test_interface_address_and_this_machines_interfaces():
    assert interface_address("lo", [LO, ETH]) == "127.0.0.1" and interface_address("wlan0", [LO]) is None
    found = list_interfaces()
    assert any(i.loopback and i.up and "127.0.0.1" in i.addresses for i in found)


@pytest.mark.parametrize("master,size,local,spans", [
    ("127.0.0.1", 4, None, False), ("node0", 4, 4, False), ("node0", 4, 2, True), ("node0", 4, None, True),
    ("node0", 1, None, False),
])
def test_which_worlds_may_span_hosts(master, size, local, spans):
    assert spans_hosts(_env(master, size, local)) is spans


def test_pinning_keeps_what_the_user_set_and_pins_loopback_on_one_node():
    environ = {"GLOO_SOCKET_IFNAME": "ib0"}
    pin_interface(_env("127.0.0.1"), environ)
    assert environ["GLOO_SOCKET_IFNAME"] == "ib0" and environ["NCCL_SOCKET_IFNAME"] in ("lo", "lo0")
    untouched: dict[str, str] = {}
    assert pin_interface(_env("node0", 4, 4), untouched) is None and untouched == {}


@pytest.mark.parametrize("text,per_host,slots", [
    ("a:2,b:2", 1, (("a", 2), ("b", 2))),
    ("a,b", 3, (("a", 3), ("b", 3))),
    ("a:1,b,a:2", 2, (("a", 3), ("b", 2))),
    ("10.0.0.1:4", 1, (("10.0.0.1", 4),)),
    ("[::1]:2", 1, (("::1", 2),)),
])
def test_host_lists_in_hydras_form(text, per_host, slots):
    assert parse_hosts(text, per_host) == slots
    assert ranks_on(slots) == sum(n for _, n in slots)


@pytest.mark.parametrize("text", ["", "a,,b", "a:0", "a:x", "a b"])
def test_bad_host_lists_say_what_to_write(text):
    with pytest.raises(ConfigError, match="--hosts"):
        parse_hosts(text, 1)


def test_host_files_in_hydras_and_open_mpis_forms():
    lines = ["# cluster", "a slots=2", "b:3  # fast one", "", "c"]
    assert parse_hostfile(lines, 4) == (("a", 2), ("b", 3), ("c", 4))
    with pytest.raises(ConfigError, match="line 1"):
        parse_hostfile(["a slots=2 extra"], 1)
    with pytest.raises(ConfigError, match="names no host"):
        parse_hostfile(["# nothing"], 1)


def test_mpiexec_gets_the_hosts_and_the_whole_world():
    hosts = hydra_hosts((("a", 2), ("b", 2)))
    cmd = mpi_command("mpiexec", 4, ["python", "x.py"], hydra=True, iface="eth0", hosts=hosts)
    assert cmd[:5] == ["mpiexec", "-n", "4", "-hosts", "a:2,b:2"] and cmd[-2:] == ["python", "x.py"]
    assert "-iface" in cmd and cmd[cmd.index("-iface") + 1] == "eth0"


def test_hosts_are_for_the_mpi_engine_and_pin_no_loopback():
    spec = LaunchSpec(nproc=1, engine="mpi", hosts=(("a", 2), ("b", 3)))
    validate(spec)
    assert spec.world_size == 5 and loopback_env({}, spec, "lo") == {}
    with pytest.raises(ConfigError, match="add --engine mpi"):
        validate(LaunchSpec(nproc=1, engine="torch", hosts=(("a", 2),)))
    with pytest.raises(ConfigError, match="--hosts a:2,b:2 or --hostfile"):
        validate(LaunchSpec(nproc=2, engine="mpi", nnodes=2, master_port=29500))


def test_a_store_that_stops_answering_says_what_happened_to_a_joiner_and_to_a_re_form():
    import dataclasses

    from popmesh.engines.torch.rendezvous import store_lost

    env = TorchEnv(rank=4, world_size=6, local_rank=0, local_world_size=2, master_addr="node0", master_port=29560,
                   store_fd=None, agent_store=True, joining=True, min_nodes=2)
    joiner = store_lost(env, RuntimeError("Broken pipe"))
    assert "cannot join the world" in str(joiner) and "node0:29560" in str(joiner) and "Broken pipe" in str(joiner)
    assert "Start a joining launcher while the world runs" in str(joiner)
    member = store_lost(dataclasses.replace(env, joining=False), RuntimeError("Broken pipe"))
    assert "cannot re-form" in str(member) and "is the launcher gone?" in str(member)
