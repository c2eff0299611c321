"""Network interfaces: which one a world's transport should listen on, from the standard library alone.

A rank on several machines must listen on an address the other machines reach. gloo (and NCCL's
bootstrap) otherwise listen on the address the host's own name resolves to, which in containers and
fresh cloud VMs is 127.0.1.1 or another loopback address, so the world never forms. The address
the kernel would use as the source toward the rendezvous host is the one that works; this module
finds it and the interface that holds it.

:func:`choose_interface` is pure (it takes the facts); the other functions read them from the kernel.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Interface",
    "Choice",
    "is_loopback",
    "list_interfaces",
    "source_address",
    "choose_interface",
    "interface_address",
]

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IF_INET6 = "/proc/net/if_inet6"
_UNROUTABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EINVAL}


@dataclass(frozen=True)
class Interface:
    """One network interface: its name, whether it is up, whether it is loopback, its addresses."""

    name: str
    up: bool
    loopback: bool
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """The interface a rank's transport should use, the address on it, and how it was found."""

    name: str
    address: str
    reason: str


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the name ``localhost``."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def list_interfaces() -> list[Interface]:
    """Every interface of this network namespace with its IPv4 (primary) and IPv6 addresses."""
    inet6 = _inet6_addresses()
    found = []
    for _, name in socket.if_nameindex():
        flags = _flags(name)
        v4 = _ipv4_address(name)
        addresses = ((v4,) if v4 else ()) + tuple(inet6.get(name, ()))
        found.append(Interface(name, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK), addresses))
    return found


def source_address(host: str, port: int = 9) -> str | None:
    """The local address the kernel picks to reach ``host`` (a routing-table lookup: a UDP socket is
    connected, nothing is sent); None when ``host`` does not resolve or no route leads there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0]).split("%", 1)[0]
        except OSError as e:
            if e.errno not in _UNROUTABLE:
                raise
    return None


def choose_interface(toward: str, source: str | None, interfaces: list[Interface]) -> Choice | None:
    """The interface for a transport that must reach the host ``toward``, whose route starts at ``source``.

    The interface holding ``source``; when the route is loopback (this is the rendezvous host, and its
    name resolves to itself locally) or unknown, the one up, non-loopback interface with an address,
    if there is exactly one. None when that leaves a choice to make (several candidates, or none).
    """
    if source is not None and not is_loopback(source):
        for iface in interfaces:
            if source in iface.addresses:
                return Choice(iface.name, source, f"it holds {source}, this host's route to {toward}")
    outside = [i for i in interfaces if i.up and not i.loopback and i.addresses]
    if len(outside) == 1:
        only = outside[0]
        why = "the route to it is loopback" if source is not None else "no route to it was found"
        return Choice(only.name, only.addresses[0], f"it is the only interface up besides loopback ({why})")
    return None


def interface_address(name: str, interfaces: list[Interface]) -> str | None:
    """The first address of the interface ``name`` (IPv4 before IPv6), None if it has none or is absent."""
    for iface in interfaces:
        if iface.name == name and iface.addresses:
            return iface.addresses[0]
    return None


def _flags(name: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return 0
    return int(struct.unpack_from("H", raw, 16)[0])


def _ipv4_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(raw[20:24])


def _inet6_addresses() -> Mapping[str, list[str]]:
    """Global and site IPv6 addresses per interface (link-local ones need a scope: left out)."""
    found: dict[str, list[str]] = {}
    try:
        with open(_IF_INET6) as table:
            rows = [line.split() for line in table]
    except OSError:
        return found
    for row in rows:
        if len(row) < 6 or row[3] == "20":  # scope 0x20: link-local
            continue
        address = str(ipaddress.IPv6Address(bytes.fromhex(row[0])))
        found.setdefault(row[5], []).append(address)
    return found
