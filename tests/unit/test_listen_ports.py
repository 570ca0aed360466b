"""The launcher's free ports for listeners (launcher/ports.py): distinct, bindable, and below the kernel's ephemeral
range, where no outgoing connection of another process can take one before the listener binds it (the fresh-clone CI
once saw a Ray rank's rendezvous port taken so: EADDRINUSE)."""

from __future__ import annotations

import socket

from shuttle.launcher.ports import EPHEMERAL_RANGE, LISTEN_PORT_MIN, free_listen_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = int(open(EPHEMERAL_RANGE).read().split()[0])
    ports = free_listen_ports(8)
    assert len(set(ports)) == 8
    if low > LISTEN_PORT_MIN:
        assert all(LISTEN_PORT_MIN <= p < low for p in ports), (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
