"""The client routes the relay forwards to workers, routed by the body's ``model``.

One table: each path maps to the error envelope its clients understand. The worker
forwards a request to the backend path of the same name, so adding a route is one
entry here (or one word in ``RELAY_ROUTES``): queueing, selection, cancellation,
requeue, deadlines, keys, usage and metrics come with it.

``RELAY_ROUTES`` (a comma list) restricts or extends the table:

- ``default`` stands for every built-in route;
- ``/path`` adds a route (errors in the OpenAI envelope, or Anthropic's for paths
  under ``/v1/messages``); ``/path=anthropic`` (or ``openai``, ``responses``) says
  which envelope;
- ``-/path`` removes one.

Unset means ``default``. A list without ``default`` is exactly the routes it names.
Only JSON bodies with a ``model`` field can be routed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from relay.wire.errors import Flavor

DEFAULT_ROUTES: dict[str, Flavor] = {
    "/v1/chat/completions": "openai",
    "/v1/responses": "responses",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/completions": "openai",
    "/v1/embeddings": "openai",
    "/v1/rerank": "openai",
    "/v1/score": "openai",
}

#: Routed paths whose requests generate nothing (token counting and templating, as
#: served by Anthropic, llama-server and vLLM): they never take or wait for a
#: generation slot, and run on any worker serving the model, at most
#: NON_GENERATING_PER_WORKER at once on each (relay/core/dispatch.py). Listed here,
#: they apply once routed (the defaults, or ``RELAY_ROUTES``).
NON_GENERATING: frozenset[str] = frozenset(
    {
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/v1/tokenize",
        "/v1/detokenize",
    }
)

#: Paths the relay answers itself; no route may shadow them.
RESERVED_PREFIXES = ("/v1/models", "/v1/worker/", "/health", "/metrics", "/admin", "/api/")
_FLAVORS: frozenset[str] = frozenset({"openai", "anthropic", "responses"})


class RouteError(ValueError):
    """A ``RELAY_ROUTES`` entry that cannot be used (the message says which and why)."""


def default_flavor(path: str) -> Flavor:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def parse_routes(entries: Iterable[str]) -> dict[str, Flavor]:
    """The route table ``RELAY_ROUTES`` describes (see the module docstring)."""
    items = [entry.strip() for entry in entries if entry.strip()]
    if not items:
        return dict(DEFAULT_ROUTES)
    table: dict[str, Flavor] = {}
    removed: set[str] = set()
    for item in items:
        if item == "default":
            for path, flavor in DEFAULT_ROUTES.items():
                table.setdefault(path, flavor)
            continue
        remove = item.startswith("-")
        path, _, envelope = item.lstrip("-").partition("=")
        path = path.rstrip("/")
        if not path.startswith("/") or any(c.isspace() or c in "?#" for c in path):
            raise RouteError(f"RELAY_ROUTES: {item!r} is not a path such as /v1/embeddings")
        if path.startswith(RESERVED_PREFIXES):
            raise RouteError(f"RELAY_ROUTES: {path} is answered by the relay itself")
        if remove:
            removed.add(path)
            continue
        if envelope and envelope not in _FLAVORS:
            raise RouteError(
                f"RELAY_ROUTES: {item!r}: the envelope must be one of {', '.join(sorted(_FLAVORS))}"
            )
        table[path] = cast(Flavor, envelope) if envelope else default_flavor(path)
    for path in removed:
        table.pop(path, None)
    return table
