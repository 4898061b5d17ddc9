"""``POST /v1/worker/join``: a worker trades a join token for a credential (SPEC §22).

The request and answer are :mod:`relay.wire.joining`'s. Refused before the body is
read: another method (405), a bad ``Host`` (400), an address throttled for failed
attempts (429 with ``Retry-After``; the throttle of bad worker secrets,
``AUTH_MAX_FAILURES`` within ``AUTH_FAILURE_WINDOW_SECS``), a declared body over
:data:`~relay.wire.joining.MAX_JOIN_BYTES` (413). Then the body is read up to that
bound and decoded strictly (400). An unknown, spent, expired or revoked token is
refused with a 401 saying which, and counts as a failed attempt of the address, like a
bad worker secret; a disabled provider is refused too (401) without counting.
"""

from __future__ import annotations

import logging

import msgspec

from relay.core.ratelimit import client_address
from relay.server import runtime
from relay.server.http.request import ClientGone, header, host_allowed, is_json, read_body
from relay.server.http.send import Receive, Scope, Send, send_error, send_json
from relay.server.identities import JoinError
from relay.wire import joining
from relay.wire.errors import (
    BadRequest,
    JoinRefused,
    MethodNotAllowed,
    PayloadTooLarge,
    RateLimited,
    RelayError,
    UnsupportedMediaType,
)

logger = logging.getLogger("relay.identities")


class JoinApp:
    """ASGI app for ``POST /v1/worker/join``, hooked into :class:`RelayHttpApp`
    (``modelrelay_site/asgi.py``)."""

    path = joining.PATH

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            answer = await self._join(scope, receive)
            # The credential is in it: no cache may keep it.
            await send_json(send, 201, answer, [(b"cache-control", b"no-store")])
        except ClientGone:
            return
        except RelayError as err:
            await send_error(send, err, "openai")

    async def _join(self, scope: Scope, receive: Receive) -> dict[str, object]:
        rt = runtime.current()
        if scope["method"] != "POST":
            raise MethodNotAllowed(f"Use POST for {self.path}", allow="POST")
        if not host_allowed(scope):
            raise BadRequest("Invalid Host header")
        forwarded = header(scope, b"x-forwarded-for")
        client = scope.get("client") or ("", 0)
        peer = client_address(
            client[0], forwarded.decode("latin-1") if forwarded else None, rt.trusted_proxies
        )
        wait = rt.throttle.blocked(peer)
        if wait:
            logger.warning("join throttled: peer=%s (%.0fs left)", peer, wait)
            raise RateLimited(
                f"too many failed attempts from this address; retry in {wait:.0f}s",
                retry_after=int(wait) + 1,
            )
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > joining.MAX_JOIN_BYTES):
            raise PayloadTooLarge(f"Request body is larger than {joining.MAX_JOIN_BYTES} bytes")
        if not is_json(header(scope, b"content-type")):
            raise UnsupportedMediaType("Send the join request as application/json")
        body = await read_body(receive, joining.MAX_JOIN_BYTES)
        try:
            asked = joining.decode_request(body)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"Invalid join request: {exc}") from None
        try:
            joined = await rt.identities.join(asked.token, asked.name, peer)
        except JoinError as exc:
            if exc.counts:
                rt.throttle.failure(peer)
            logger.warning("join refused: peer=%s: %s", peer, exc.reason)
            raise JoinRefused(exc.reason) from None
        rt.throttle.success(peer)
        logger.info(
            "worker %r joined provider %s as #%d from %s",
            joined.name,
            joined.provider,
            joined.worker_id,
            peer,
        )
        answer = joining.JoinAnswer(
            worker_id=joined.worker_id,
            name=joined.name,
            provider=joined.provider,
            credential=joined.credential,
        )
        return msgspec.to_builtins(answer)
