"""Raw ZeroMQ peers of the batch endpoint, for tests that speak its wire format by hand."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from shuttle.common.messages import BatchHeartbeat, BatchServerMessage

HANG = 30.0  # seconds before a test waiting on the endpoint gives up (a hang, not a timing margin)


async def dealer(endpoint: str) -> zmq.asyncio.Socket:
    """A DEALER connected to `endpoint` (close it yourself)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


async def next_response(sock: zmq.asyncio.Socket):
    """The next message from the server that is not a heartbeat, decoded as a BatchServerMessage."""
    while True:
        message = msgspec.msgpack.decode(await asyncio.wait_for(sock.recv(), HANG), type=BatchServerMessage)
        if not isinstance(message, BatchHeartbeat):
            return message
