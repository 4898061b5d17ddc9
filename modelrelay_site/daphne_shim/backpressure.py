"""Streamed HTTP responses get backpressure, as under uvicorn.

daphne hands every ``http.response.body`` to Twisted at once, so a client that reads
slower than the relay writes would make Twisted's transport buffer grow without bound.
Here a ``send`` of a body part returns only once the transport's buffer is back under
its limit (Twisted's producer protocol tells when), and a ``send`` the application
cancels while it waits (it gave up on that client) aborts the connection. A part in
the middle of a chunked stream goes straight to the transport.
"""

from __future__ import annotations

import asyncio
from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


class _Waker:
    """A Twisted push producer that only wakes an asyncio future when the transport drains."""

    def __init__(self, wake: Any) -> None:
        self.resumeProducing = wake
        self.stopProducing = wake

    def pauseProducing(self) -> None:
        pass


async def _wait_for_client(request: Any) -> None:
    """Return once ``request``'s transport buffer is under its limit (or the client left).

    Cancelled while waiting: the application gave up on a client that reads nothing,
    so its connection is aborted rather than left holding what it would not read.
    """
    channel = request.channel
    if channel is None or not channel._waitingForTransport or request.finished:
        return
    done = asyncio.get_running_loop().create_future()

    def wake(*_: Any) -> None:
        if not done.done():
            done.set_result(None)

    producer = _Waker(wake)
    channel.registerProducer(producer, True)
    request.notifyFinish().addBoth(wake)  # connection lost
    try:
        await done
    except asyncio.CancelledError:
        transport = channel.transport
        if transport is not None:
            transport.abortConnection()
        raise
    finally:
        if channel._requestProducer is producer:
            channel.unregisterProducer()


def apply() -> None:
    from daphne.http_protocol import WebRequest
    from daphne.server import Server

    original = Server.handle_reply

    async def handle_reply(self: Any, protocol: Any, message: dict[str, Any]) -> None:
        if message.get("type") != "http.response.body" or not isinstance(protocol, WebRequest):
            await original(self, protocol, message)
            return
        # daphne's own checks for a body part (the header checks are for the start).
        connection = self.connections.get(protocol)
        if connection is None or connection.get("disconnected"):
            return
        if not message.get("more_body"):
            protocol.handle_reply(message)
            return
        if (
            protocol.startedWriting
            and protocol.chunked
            and not protocol.finished
            and protocol.channel is not None
            and "write" not in protocol.__dict__  # HEAD or a status without a body
        ):
            # A part in the middle of a chunked stream, headers long sent: what
            # Twisted's Request.write would send, without its bookkeeping per part.
            body = message.get("body", b"")
            if body:
                protocol.sentLength += len(body)
                protocol.channel.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            protocol.handle_reply(message)
        await _wait_for_client(protocol)

    Server.handle_reply = handle_reply


PATCH = Patch(
    "backpressure",
    ("daphne", "twisted"),
    (
        "daphne.server:Server.handle_reply",
        "daphne.server:Server.connections",
        "daphne.http_protocol:WebRequest.handle_reply",
        "daphne.http_protocol:WebRequest.startedWriting",
        "daphne.http_protocol:WebRequest.chunked",
        "daphne.http_protocol:WebRequest.finished",
        "daphne.http_protocol:WebRequest.sentLength",
        "daphne.http_protocol:WebRequest.notifyFinish",
        "twisted.web.http:HTTPChannel._waitingForTransport",
        "twisted.web.http:HTTPChannel._requestProducer",
        "twisted.web.http:HTTPChannel.registerProducer",
        "twisted.web.http:HTTPChannel.unregisterProducer",
    ),
    apply,
)
