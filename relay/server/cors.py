"""CORS for browser-based clients: off unless origins are configured (``*`` allowed)."""

from __future__ import annotations

from collections.abc import Iterable

Headers = list[tuple[bytes, bytes]]

_ALLOW_HEADERS = (
    b"authorization, content-type, x-api-key, anthropic-version, anthropic-beta, "
    b"openai-organization, openai-project, x-stainless-arch, x-stainless-lang, "
    b"x-stainless-os, x-stainless-package-version, x-stainless-runtime, "
    b"x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout, "
    b"anthropic-dangerous-direct-browser-access, x-deadline-ms"
)


class CorsPolicy:
    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(o.rstrip("/") for o in origins)
        self.any = "*" in self.origins

    def headers(self, origin: bytes | None) -> Headers | None:
        """Response headers for a request from ``origin``; ``None`` when CORS does not apply."""
        if not self.origins or origin is None:
            return None
        if self.any:
            allow = b"*"
        elif origin.decode("latin-1") in self.origins:
            allow = origin
        else:
            return None
        return [
            (b"access-control-allow-origin", allow),
            (b"vary", b"origin"),
            (b"access-control-expose-headers", b"retry-after, x-request-id"),
        ]

    @staticmethod
    def preflight() -> Headers:
        return [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", _ALLOW_HEADERS),
            (b"access-control-max-age", b"600"),
        ]
