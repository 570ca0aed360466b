"""Are the TCP ports a launch will listen on free? Checked by the launcher before any process starts (the frontend
binds its ports only after the model has loaded), with a message naming the port and the flag that chose it.

A check is a bind and listen on the same address with SO_REUSEADDR, as the servers themselves do (aiohttp's
reuse_address, ZeroMQ's tcp listener): a port held only by connections in TIME_WAIT passes, one that another
process listens on fails. The sockets of one check stay open until it ends, so two of the launch's own ports that
coincide are found too. A port can still be taken between the check and the bind; the frontend then reports it.
"""

from __future__ import annotations

import errno
import random
import socket
from dataclasses import dataclass

from shuttle.common.errors import ShuttleError


class PortError(ShuttleError):
    """A port the launch needs cannot be listened on; the message is one line naming the port and its flag."""


@dataclass(frozen=True)
class Listen:
    """One TCP address the launch will listen on.

    Attributes:
        host: the address (a name, an IPv4 or IPv6 literal, "*" or "" for every interface).
        port: 1..65535.
        what: which server it is and the flag that sets it, e.g. "the HTTP server, --port".
    """

    host: str
    port: int
    what: str


def tcp_listen(endpoint: str, what: str) -> Listen | None:
    """The Listen of a ZeroMQ endpoint "tcp://HOST:PORT"; None for other transports and for port "*" or 0 (the OS
    picks a free one)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    return Listen(host.strip("[]"), int(port), what)


def check_ports(listens: list[Listen]) -> None:
    """Bind and listen on each address in turn, then let them all go.

    Raises:
        PortError: the first that fails: out of range, in use (also by an earlier one of `listens`), not an
            address of this host, not allowed (a port below 1024), or a host name that does not resolve.
    """
    held: list[socket.socket] = []
    try:
        for listen in listens:
            held.extend(_bind(listen))
    finally:
        for sock in held:
            sock.close()


def _bind(listen: Listen) -> list[socket.socket]:
    where = f"port {listen.port} ({listen.what})"
    if not 0 < listen.port < 65536:
        raise PortError(f"{where} is not a TCP port (1-65535)")
    host = None if listen.host in ("", "*") else listen.host
    try:
        addresses = socket.getaddrinfo(host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortError(f"{where}: cannot resolve host {listen.host!r} ({exc.strerror})") from None
    held = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):  # without repeats, in resolver order
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server
            try:
                sock.bind(address)
                sock.listen(1)
            except OSError as exc:
                raise PortError(_refusal(where, listen.host, exc)) from None
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


def _refusal(where: str, host: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{where} is in use on {host or '*'}; free it or choose another"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this host"
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges)"
    return f"{where}: cannot listen on {host or '*'}: {exc.strerror or exc}"


LISTEN_PORT_MIN = 20000  # above Ray's worker ports (10002-19999 by default)
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_listen_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` now, for listeners that bind them a moment later (a scheduler's
    sockets, a torch.distributed rendezvous).

    They are drawn below the kernel's ephemeral range (Linux's ip_local_port_range, 32768-60999 by default), so that
    no other process's outgoing connection, whose local port the kernel takes from that range, can take one between
    this check and the listener's bind. Port 0's pick lies inside that range: on a busy host (a Ray node's many
    connections) the rendezvous port was taken that way. Where the range leaves no room below it, the kernel picks.
    """
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    held: list[socket.socket] = []
    try:
        rng = random.Random()
        for _ in range(50 * n):
            if len(held) == n or low <= LISTEN_PORT_MIN:
                break
            s = socket.socket()
            try:
                s.bind((host, rng.randrange(LISTEN_PORT_MIN, low)))
            except OSError:
                s.close()
                continue
            held.append(s)
        while len(held) < n:
            s = socket.socket()
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
