"""Which headers cross the relay, in each direction.

Requests: only the allowlist a backend needs to answer as the client expects
(credentials for the backend, content type, OpenAI org/project, Anthropic version
and betas). Responses: everything the backend sent except hop-by-hop headers, the
framing the relay recomputes itself, and what the relay owns: cookies and CORS.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

FORWARDED_REQUEST_HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "openai-organization",
        "openai-project",
        "x-api-key",
        "anthropic-version",
        "anthropic-beta",
    }
)

# RFC 9110 §7.6.1 plus the de-facto ones; content-length and content-encoding are
# recomputed by the relay (the worker hands over the decoded body).
DROPPED_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
    }
)


#: Response headers only the relay may set: a worker cannot plant cookies for the
#: relay's origin or widen (or duplicate) its CORS policy, and ``x-modelrelay-`` names
#: carry signals between server processes, which nothing a worker sends may forge.
RELAY_OWNED_PREFIXES = ("set-cookie", "access-control-", "x-modelrelay-")


def forwarded_request_headers(
    raw: Iterable[tuple[bytes, bytes]], *, exclude: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Pick the allowlisted request headers from an ASGI header list.

    ``exclude`` names headers that authenticated the client to the relay itself;
    those are relay credentials and must never reach a backend.
    """
    out: dict[str, str] = {}
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
        if name in FORWARDED_REQUEST_HEADERS and name not in exclude:
            value = value_b.decode("latin-1")
            out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def response_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """Backend response headers as an ASGI list, minus hop-by-hop and framing."""
    out: list[tuple[bytes, bytes]] = []
    connection_tokens: set[str] = set()
    for name, value in headers.items():
        if name.lower() == "connection":
            connection_tokens.update(t.strip().lower() for t in value.split(","))
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in DROPPED_RESPONSE_HEADERS or lowered in connection_tokens:
            continue
        if lowered.startswith(RELAY_OWNED_PREFIXES):
            continue
        if not _is_token(lowered) or _CONTROL.search(value):
            continue  # (a server would refuse, or pass on, a control character)
        out.append((lowered.encode("latin-1"), value.encode("latin-1", "replace")))
    return out


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")


def _is_token(name: str) -> bool:
    return bool(name) and all(c in _TOKEN_CHARS for c in name)
