"""The client-facing hot path: a small ASGI app routed ahead of Django.

Inference routes, ``/v1/models``, ``/health`` and ``/metrics`` are served here
directly, so they pay none of Django's per-request thread hand-offs; the paths
Django serves fall through to it (admin, JSON API, pages); every other path gets a
JSON 404 in the envelope its client speaks.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings

from relay.server import runtime
from relay.server.batches import api as batches
from relay.server.http import early, info, reattach
from relay.server.http.inference import inference, placed_here
from relay.server.http.request import (
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    host_allowed,
    route_table,
)
from relay.server.http.send import ASGIApp, Receive, Scope, Send, send_error
from relay.wire.errors import BadRequest, HeadersTooLarge, PayloadTooLarge, RelayError

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
        if early.body_left(scope["headers"]):
            receive, send = _closing(receive, send)
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
            ours = ours or batches.serves(path) or reattach.serves(path)
            if flavor is not None and early.internal(headers):
                # Placed here by another process; any other value of the header is
                # ignored and the request checked as a client's.
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
            elif reattach.serves(path):  # reattaching to a resumable response (SPEC §18)
                await reattach.handle(scope, receive, send)
            elif batches.serves(path):  # Files, Batches, Message Batches (SPEC §16)
                await batches.handle(scope, receive, send)
            elif path in self.routes:
                await self.routes[path](scope, receive, send)
            elif path.startswith("/v1/") or not early.django_serves(path):
                # Never Django's HTML page for a path nothing serves (llama-server's
                # /tokenize, /props ...): JSON in the envelope the client speaks.
                await info.unknown(scope, send, path)
            elif (too_large := early.too_large_for_django(headers)) is not None:
                # Django would read (and spool) all of it before refusing it.
                await send_error(send, too_large, early.envelope(path, headers))
            elif early.body_left(headers):
                await self._capped_fallback(scope, receive, send)
                return
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

    async def _capped_fallback(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Django for a request whose body may be large (chunked, or declared under the
        cap): past ``DATA_UPLOAD_MAX_MEMORY_SIZE`` Django is told the client left (it
        would have read and spooled all of it, only to refuse it) and the client gets
        a 413 — what the daphne shim answers at the same point."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is None:
            await self.fallback(scope, receive, send)
            return
        received = 0
        over = started = False

        async def capped() -> dict[str, Any]:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.fallback(scope, capped, watched)
        if over and not started:
            err = PayloadTooLarge(f"Request body is larger than {limit} bytes")
            await send_error(send, err, early.envelope(scope["path"], scope["headers"]))


def _closing(receive: Receive, send: Send) -> tuple[Receive, Send]:
    """``receive`` and ``send`` for a request with a large or chunked body: answered
    before its body was read to the end (a refusal), the response says
    ``Connection: close``, so the server closes the connection rather than read the
    rest (uvicorn would read and discard it all; the next request could never come)."""
    done = False

    async def receiving() -> dict[str, Any]:
        nonlocal done
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not done:
            message = {**message, "headers": [*message.get("headers", []), early.CLOSE]}
        await send(message)

    return receiving, sending


def refused_before_body(
    method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> early.Verdict:
    """For the server, before a request's body is read: the answer a request gets
    anyway on its headers alone, or how much body it may send
    (:mod:`relay.server.http.early`)."""
    return early.check(method, path, headers)
