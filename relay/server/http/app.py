"""The client-facing hot path: a small ASGI app routed ahead of Django.

Inference routes, ``/v1/models``, ``/health`` and ``/metrics`` are served here
directly, so they pay none of Django's per-request thread hand-offs; every other
path falls through to Django (admin, JSON API, pages).
"""

from __future__ import annotations

import logging

from relay.server import runtime
from relay.server.batches import api as batches
from relay.server.http import info
from relay.server.http.inference import TOKEN_HEADER_B, inference, placed_here
from relay.server.http.request import (
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    header,
    host_allowed,
    route_table,
)
from relay.server.http.send import ASGIApp, Receive, Scope, Send, send_error
from relay.wire.errors import BadRequest, Flavor, HeadersTooLarge, RelayError

logger = logging.getLogger("relay.http")


class RelayHttpApp:
    """ASGI app: relay routes here, everything else to ``fallback`` (Django)."""

    def __init__(self, fallback: ASGIApp, routes: dict[str, ASGIApp] | None = None) -> None:
        self.fallback = fallback
        #: More exact paths served here, each by its own ASGI app (the old client API).
        self.routes = routes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        rt = runtime.current()
        rt.http_started()  # a stopping server lets these finish (see Runtime.shutdown)
        try:
            await self._serve(scope, receive, send)
        finally:
            rt.http_finished()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        flavor = route_table().get(path)
        headers = scope["headers"]
        if len(headers) > MAX_HEADER_COUNT or (
            sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES
        ):
            await send_error(send, HeadersTooLarge(), flavor or "openai")
            return
        try:
            ours = flavor is not None or path in ("/health", "/metrics", "/metrics/workers")
            ours = ours or path == "/v1/models"
            ours = ours or batches.serves(path)
            internal = flavor is not None and header(scope, TOKEN_HEADER_B) is not None
            if internal:
                assert flavor is not None
                await placed_here(scope, receive, send, flavor)
                return
            if (ours or path.startswith("/v1/models/")) and not host_allowed(scope):
                # As Django answers for every other path (DNS rebinding, SPEC §5).
                await send_error(send, BadRequest("Invalid Host header"), flavor or "openai")
                return
            if flavor is not None:
                await inference(scope, receive, send, flavor)
            elif path == "/health":
                await info.health(scope, send)
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                await info.models(scope, send, path)
            elif path == "/metrics":
                await info.metrics(scope, send)
            elif path == "/metrics/workers":
                await info.worker_metrics(scope, send)
            elif batches.serves(path):  # Files, Batches, Message Batches (SPEC §16)
                await batches.handle(scope, receive, send)
            elif path in self.routes:
                await self.routes[path](scope, receive, send)
            elif path.startswith("/v1/"):
                await info.unknown(scope, send, path)
            else:
                await self.fallback(scope, receive, send)
                return
        except Exception:
            # A bug, not the client's doing: log it once and answer in the envelope
            # rather than let the server write its own HTML error page.
            logger.exception("unexpected error serving %s %s", scope.get("method"), path)
            try:
                fallback = batches.flavor_of(path) if batches.serves(path) else "openai"
                await send_error(send, RelayError(), flavor or fallback)
            except Exception:
                pass  # the response had already started: the server ends it


def refused_before_body(
    method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> tuple[RelayError, Flavor] | None:
    """For the server, before a request's body is read: the error a request to one of
    the routes served here besides the relayed ones gets anyway (a file upload over
    its size limit or without a valid key), with the envelope to answer it in."""
    if not batches.serves(path):
        return None
    err = batches.refused_before_body(method, path, headers)
    return None if err is None else (err, batches.flavor_of(path))
