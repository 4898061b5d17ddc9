"""Let the relay cut off an HTTP client that reads nothing, under uvicorn.

uvicorn already gives streamed responses backpressure: a ``send`` waits while the
transport's buffer is over its limit. What it cannot do is end a response the
application gave up on: returning without completing it only closes the transport
(which keeps the unread data until the client reads it) and logs an error. Here a
``send`` the application cancels while it waits for such a client aborts the
connection instead, as :mod:`modelrelay_site.daphne_shim` does under daphne.
It also stops uvicorn from taking a POST that carries ``Upgrade: websocket`` for a
WebSocket handshake: it would hand the connection to its WebSocket protocol, which
never answers a POST. Such a request is an ordinary HTTP request (daphne answers it
like any other).

And a worker's text frame that is not UTF-8 is the peer's fault, not a server error:
uvicorn logs it as an ERROR with a traceback; the worker consumer already logs the
1007 close in one line, so uvicorn's record is dropped.
Installed by ``manage.py serve --server uvicorn``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any


def install() -> None:
    from uvicorn.protocols.http import h11_impl, httptools_impl

    for module in (httptools_impl, h11_impl):
        cycle = module.RequestResponseCycle
        if getattr(cycle, "_relay_abort_on_cancel", False):
            continue
        cycle.send = _aborting(cycle.send)
        cycle._relay_abort_on_cancel = True
    for protocol in (httptools_impl.HttpToolsProtocol, h11_impl.H11Protocol):
        _get_upgrades_only(protocol)
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _PeerFaults) for f in logger.filters):
        logger.addFilter(_PeerFaults())


class _PeerFaults(logging.Filter):
    """Drops uvicorn's traceback for a peer's invalid UTF-8 (logged by the consumer)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid UTF-8 sequence received from client."


def _get_upgrades_only(protocol: Any) -> None:
    if getattr(protocol, "_relay_get_upgrades_only", False):
        return
    original = protocol._should_upgrade

    def should_upgrade(self: Any) -> bool:
        return self.scope.get("method") == "GET" and bool(original(self))

    protocol._should_upgrade = should_upgrade
    protocol._relay_get_upgrades_only = True


def _aborting(original: Any) -> Any:
    async def send(self: Any, message: Any) -> None:
        try:
            await original(self, message)
        except asyncio.CancelledError:
            if self.flow.write_paused and not self.disconnected:
                # Marked before the transport reports it, so uvicorn does not log the
                # response the application deliberately left unfinished.
                self.disconnected = True
                self.transport.abort()
            raise

    return send
