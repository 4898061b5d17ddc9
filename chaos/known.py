"""Product failures the harness has found and that are not fixed yet.

Each entry names the check it makes fail and exactly which of that check's counted
problems it explains (verdicts, case labels, problem kinds, log signatures), and
under which server. A failing check is *explained* only when every problem it
counted belongs to a known entry; anything else is a new failure.
``tests/test_chaos.py`` marks a scenario xfail (naming the entries) when all its
failures are explained, and fails it otherwise. docs/RELIABILITY.md describes each.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from chaos.outcome import Check, Outcome

BOTH = frozenset({"daphne", "uvicorn"})
UVICORN = frozenset({"uvicorn"})


@dataclass(frozen=True)
class Known:
    key: str
    summary: str
    check: str
    #: The check's ``data`` field the problems are listed under, and the ones explained
    #: (shell-style patterns: a counted problem is explained when it matches one).
    field: str
    problems: frozenset[str]
    servers: frozenset[str] = BOTH


KNOWN = [
    Known(
        "worker-drain-503",
        "a worker that is shutting down answers the requests the server sent it after its "
        "SIGTERM with 503 instead of handing them back (error code worker_draining), so "
        "the client gets 503 where another worker could have served it",
        "verdicts",
        "unexpected",
        frozenset({"error:503:service_unavailable"}),
    ),
    Known(
        "v1-html-404",
        "unknown /v1/ paths get Django's HTML 404 page, not a JSON error (SPEC §5)",
        "HTTP: JSON errors on /v1/ routes",
        "labels",
        frozenset({"unknown /v1/ path", "POST to an unknown /v1/ path"}),
    ),
    Known(
        "uvicorn-204-body",
        "under uvicorn a worker's 204/304 answer reaches the client with its body "
        "(SPEC §5: no body), which desynchronises a keep-alive connection",
        "hostile lane answered",
        "kinds",
        frozenset({"body on 204/304"}),
        UVICORN,
    ),
    Known(
        "uvicorn-header-control-char",
        "a worker's response header value with a control character other than CR/LF/NUL "
        "makes uvicorn refuse the response: the client's connection is dropped with no "
        "answer and the server logs a traceback",
        "hostile lane answered",
        "kinds",
        frozenset({"no answer (eof)"}),
        UVICORN,
    ),
    Known(
        "uvicorn-header-control-char-log",
        "(the same, in the server log)",
        "logs clean",
        "signatures",
        frozenset(
            {
                "relay.http: unexpected error serving POST /v1/* / "
                "RuntimeError: Invalid HTTP header value.",
                "uvicorn.error: ASGI callable returned without completing response.",
            }
        ),
        UVICORN,
    ),
    Known(
        "uvicorn-upgrade-hang",
        "under uvicorn a POST to an API route with 'Upgrade: websocket' gets no answer "
        "and its connection stays open",
        "HTTP: a reaction to every complete request",
        "labels",
        frozenset({"Upgrade: websocket on an API route"}),
        UVICORN,
    ),
    Known(
        "uvicorn-utf8-traceback",
        "under uvicorn every WebSocket text frame with invalid UTF-8 logs an ERROR with a "
        "traceback (the worker is still closed with 1007)",
        "logs clean",
        "signatures",
        frozenset(
            {
                "uvicorn.error: Invalid UTF-8 sequence received from client. / UnicodeDecodeError*",
                # A second such frame while uvicorn is already closing the connection.
                "asyncio: Fatal error on transport *WebSocketsSansIOProtocol*"
                " / websockets.exceptions.InvalidState: connection is closing",
            }
        ),
        UVICORN,
    ),
]


def explains(check: Check, server: str) -> list[Known]:
    """The known entries that together explain every problem ``check`` counted, or []."""
    if check.ok:
        return []
    applicable = [k for k in KNOWN if k.check == check.name and server in k.servers]
    used: dict[str, Known] = {}
    counted = 0
    for known_field in {k.field for k in applicable}:
        problems = check.data.get(known_field)
        if not isinstance(problems, dict):
            continue
        for problem in problems:
            counted += 1
            match = [k for k in applicable if k.field == known_field and _covers(k, problem)]
            if not match:
                return []
            used.update((k.key, k) for k in match)
    return list(used.values()) if counted else []


def _covers(known: Known, problem: str) -> bool:
    return any(fnmatch.fnmatchcase(problem, pattern) for pattern in known.problems)


def unexplained(outcome: Outcome, server: str) -> list[Check]:
    return [c for c in outcome.failures if not explains(c, server)]


def explained(outcome: Outcome, server: str) -> list[Known]:
    found: dict[str, Known] = {}
    for check in outcome.failures:
        for known in explains(check, server):
            found[known.key] = known
    return list(found.values())
