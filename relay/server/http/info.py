"""The small JSON routes of the fast path: ``/health``, ``/metrics``, ``/v1/models``, and
the JSON 404/405 of every path nothing serves."""

from __future__ import annotations

import bisect
import hmac
import time
from typing import Any
from urllib.parse import parse_qs

from relay import __version__
from relay.server import runtime
from relay.server.http.early import envelope, unknown_path
from relay.server.http.request import header
from relay.server.http.send import Scope, Send, send_error, send_json, send_simple
from relay.server.metrics import CONTENT_TYPE
from relay.wire.errors import (
    BadRequest,
    Flavor,
    MethodNotAllowed,
    ModelNotFound,
    RelayError,
)


async def unknown(scope: Scope, send: Send, path: str) -> None:
    """Every path nothing serves: JSON in the envelope the client speaks, never HTML."""
    headers = scope["headers"]
    await send_error(send, unknown_path(path, headers, scope["method"]), envelope(path, headers))


async def health(scope: Scope, send: Send) -> None:
    rt = runtime.current()
    relay = rt.relay
    draining = relay.shutting_down
    document: dict[str, Any] = {
        "status": "draining" if draining else "ok",
        "version": __version__,
        "workers_connected": len(relay.registry.workers),
        "queue_depth": relay.queue_depth(),
        "uptime_secs": round(time.time() - relay.started_wall, 3),
    }
    if rt.placement is not None:
        # Cluster mode: degraded (Redis unreachable) still serves this process's
        # workers, so it stays a 200; the state says which.
        document["cluster"] = rt.placement.describe()
    await send_json(send, 503 if draining else 200, document)


async def metrics(scope: Scope, send: Send) -> None:
    rt = runtime.current()
    if await _metrics_allowed(scope, send):
        await _send_metrics(send, rt.metrics.render())


async def worker_metrics(scope: Scope, send: Send) -> None:
    """``GET /metrics/workers``: the federated metrics of this process's workers
    (SPEC §17), behind the same token as ``/metrics``."""
    rt = runtime.current()
    if not await _metrics_allowed(scope, send):
        return
    body, refusals = await rt.federation.render()
    for worker_id, refusal in refusals:
        worker = rt.relay.registry.workers.get(worker_id)
        if worker is not None and worker.attached:
            worker.link.send(refusal)
    await _send_metrics(send, body)


async def _metrics_allowed(scope: Scope, send: Send) -> bool:
    token = runtime.current().metrics_token
    if token:
        given = header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, b"Bearer " + token.encode()):
            await send_simple(send, 403, [(b"content-type", b"text/plain")], b"forbidden\n")
            return False
    return True


async def _send_metrics(send: Send, body: bytes) -> None:
    headers = [
        (b"content-type", CONTENT_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send_simple(send, 200, headers, body)


async def models(scope: Scope, send: Send, path: str) -> None:
    rt = runtime.current()
    cors = rt.cors.headers(header(scope, b"origin")) or []
    anthropic = header(scope, b"anthropic-version") is not None
    flavor: Flavor = "anthropic" if anthropic else "openai"
    await rt.ready()
    try:
        if scope["method"] not in ("GET", "HEAD"):
            raise MethodNotAllowed("Use GET for /v1/models", allow="GET, HEAD")
        key_id, _ = rt.authenticate(scope["headers"], flavor)
        single = path not in ("/v1/models", "/v1/models/")
        if single and rt.placement is not None:
            wanted = path[len("/v1/models/") :]
            if not rt.relay.knows(wanted):  # it may have registered a moment ago elsewhere
                await rt.placement.learn(wanted)
        models = rt.relay.routable_models()
        if key_id is not None:
            limits = rt.key_limits(key_id)
            rt.limiter.check_expiry(key_id, limits)
            if limits.allowed_models is not None:  # a key sees only what it may use
                models = {m: p for m, p in models.items() if m in limits.allowed_models}
        created = int(rt.relay.started_wall)
        # Models on demand (SPEC §19): loadable models are listed too, each with its
        # best state on a worker in an extra field (SDKs ignore fields they do not know).
        states = rt.relay.model_state_view()

        def describe(model: str) -> dict[str, Any]:
            document: dict[str, Any]
            if anthropic:
                document = {
                    "type": "model",
                    "id": model,
                    "display_name": model,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                }
            else:
                owner = ",".join(sorted(models[model]))
                document = {"id": model, "object": "model", "created": created, "owned_by": owner}
            state = states.get(model)
            if state is not None:
                document["state"] = state
            return document

        if single:
            model_id = path[len("/v1/models/") :]
            if model_id not in models:
                raise ModelNotFound(model_id)
            await send_json(send, 200, describe(model_id), cors)
            return
        names = sorted(models)
        if anthropic:
            page, has_more = anthropic_page(names, scope.get("query_string", b""))
            data = [describe(m) for m in page]
            document: dict[str, Any] = {
                "data": data,
                "has_more": has_more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        else:
            document = {"object": "list", "data": [describe(m) for m in names]}
    except RelayError as err:
        await send_error(send, err, flavor, cors)
        return
    await send_json(send, 200, document, cors)


def anthropic_page(names: list[str], query: bytes) -> tuple[list[str], bool]:
    """One page of the (sorted) model names as Anthropic's list API pages them:
    ``limit`` (1-1000, default 20), ``after_id`` or ``before_id``; and whether more
    lie beyond it in that direction."""
    params = parse_qs(query.decode("latin-1"))
    raw_limit = (params.get("limit") or ["20"])[0]
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 1000:
        raise BadRequest("limit must be an integer from 1 to 1000")
    limit = int(raw_limit)
    after = params.get("after_id", [None])[0]
    before = params.get("before_id", [None])[0]
    if before is not None:
        end = bisect.bisect_left(names, before)
        start = max(0, end - limit)
        return names[start:end], start > 0
    start = bisect.bisect_right(names, after) if after is not None else 0
    return names[start : start + limit], start + limit < len(names)
