"""Let the relay cut off an HTTP client that reads nothing, under uvicorn.

uvicorn already gives streamed responses backpressure: a ``send`` waits while the
transport's buffer is over its limit. What it cannot do is end a response the
application gave up on: returning without completing it only closes the transport
(which keeps the unread data until the client reads it) and logs an error. Here a
``send`` the application cancels while it waits for such a client aborts the
connection instead, as :mod:`modelrelay_site.daphne_compat` does under daphne.
Installed by ``manage.py serve --server uvicorn``.
"""

from __future__ import annotations

import asyncio
from typing import Any


def install() -> None:
    from uvicorn.protocols.http import h11_impl, httptools_impl

    for module in (httptools_impl, h11_impl):
        cycle = module.RequestResponseCycle
        if getattr(cycle, "_relay_abort_on_cancel", False):
            continue
        cycle.send = _aborting(cycle.send)
        cycle._relay_abort_on_cancel = True


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
