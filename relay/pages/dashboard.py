"""The live dashboard (SPEC §9): a staff page fed by a server-sent event stream.

``/dashboard`` renders the page with a first snapshot embedded; the page's script
then follows ``/dashboard/events``, one JSON snapshot of the relay per second, and
redraws in place. Drain and refresh buttons POST (with the CSRF token) to
``/dashboard/workers/<id>/<action>`` (a drain may carry ``timeout_secs``, form-encoded
or JSON). All data comes from :mod:`relay.core.snapshot`; these views only check who is
asking and translate to HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseRedirect,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import render
from django.views.decorators.http import require_POST

from relay.core import snapshot
from relay.core.keystats import fold
from relay.server import runtime
from relay.server.admin.api import DRAIN_TIMEOUT_RULE, valid_drain_timeout
from relay.server.cluster.control import ClusterUnreachable

logger = logging.getLogger("relay.pages")

#: Seconds between two snapshots on the event stream.
EVENT_INTERVAL_SECS = 1.0
#: A stream ends after this long; the browser reconnects (and is re-authorised).
STREAM_MAX_SECS = 600.0
#: What the browser waits before reconnecting, in milliseconds (the SSE ``retry`` field).
RECONNECT_MS = 2000
DRAIN_PERMISSION = "workers_app.drain_worker"


class StreamCount:
    """Open event streams in this process (tests check that closed streams are cleaned up)."""

    open = 0


async def staff_user(request: HttpRequest) -> Any | None:
    """The logged-in active staff user, or None."""
    user = await request.auser()
    if user.is_authenticated and user.is_active and user.is_staff:
        return user
    return None


def forbidden(message: str = "staff login required") -> JsonResponse:
    return JsonResponse({"detail": message}, status=403)


def home(request: HttpRequest) -> HttpResponse:
    """``/``: staff go to the dashboard, everyone else to the setup wizard."""
    user = request.user
    return HttpResponseRedirect("/dashboard" if user.is_active and user.is_staff else "/setup")


async def live_snapshot(rt: runtime.Runtime) -> dict[str, Any]:
    # "Who is using the pool": the busiest keys by name, the rest as one (other) row.
    keys_list = fold(await rt.key_usage()) if rt.require_keys else None
    document = snapshot.dashboard(
        rt.relay, workers_list=await rt.workers(), keys_list=keys_list, key_name=rt.key_name
    )
    document["recent"] = recent_by_end(document["recent"])
    # Batches (SPEC §16): those with work left and the last few ended, as of the
    # engine's last look at the database (every process's).
    document["batches"] = [{**row, "api_status": api_status(row)} for row in rt.batches.batches]
    if rt.placement is not None:
        # Cluster mode: the queue that matters is the shared one (as of the last second).
        document["stats"]["queue_depth"] = rt.placement.queue_depth
        document["stats"]["cluster"] = rt.placement.describe()
    return document


def recent_by_end(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recent requests with when each ended (``ended_at``, epoch seconds), latest
    first: the list holds them as they finished, and a long request that arrived
    before a short one ends after it, so the time shown is the end's."""
    ended = [{**row, "ended_at": round(row["at"] + row["duration_ms"] / 1000, 3)} for row in rows]
    ended.sort(key=lambda row: row["ended_at"], reverse=True)
    return ended


#: Batch statuses after which nothing runs (the Batch API's terminal states).
ENDED_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


def api_status(row: dict[str, Any]) -> str:
    """A batch's status as its own API says it: the Batch API's as stored; Message
    Batches' ``in_progress``, ``canceling`` or ``ended`` (as ``GET
    /v1/messages/batches/<id>`` answers, :func:`relay.server.batches.shapes.anthropic_status`)."""
    status = str(row["status"])
    if row.get("api") != "anthropic":
        return status
    if status == "cancelling":
        return "canceling"
    return "ended" if status in ENDED_STATUSES else "in_progress"


@staff_member_required
async def dashboard(request: HttpRequest) -> HttpResponse:
    user = await request.auser()
    context = {
        # The async view passes the user itself: the template must not load it lazily.
        "user": user,
        "nav": "dashboard",
        "initial": await live_snapshot(runtime.current()),
        "can_act": await user.ahas_perm(DRAIN_PERMISSION),
        "events_url": "/dashboard/events",
    }
    return render(request, "relay/dashboard.html", context)


async def _snapshots(rt: runtime.Runtime) -> AsyncIterator[str]:
    """One ``data:`` event per interval until the client leaves, the server stops or time is up.

    Django cancels this generator (CancelledError) when the client disconnects.
    """
    StreamCount.open += 1
    try:
        yield f"retry: {RECONNECT_MS}\n\n"
        relay = rt.relay
        deadline = relay.loop.time() + STREAM_MAX_SECS
        while not relay.shutting_down and relay.loop.time() < deadline:
            yield f"data: {json.dumps(await live_snapshot(rt))}\n\n"
            await asyncio.sleep(EVENT_INTERVAL_SECS)
    finally:
        StreamCount.open -= 1


async def events(request: HttpRequest) -> HttpResponseBase:
    """``/dashboard/events``: the live snapshot stream (text/event-stream), staff only."""
    if await staff_user(request) is None:
        return forbidden()
    response = StreamingHttpResponse(
        _snapshots(runtime.current()), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


class BadInput(ValueError):
    pass


def _drain_timeout(request: HttpRequest) -> float | None:
    """The optional ``timeout_secs`` of a drain; raises BadInput unless it is valid."""
    if request.content_type == "application/json":
        try:
            document = json.loads(request.body or b"{}")
        except ValueError:
            raise BadInput("the body is not valid JSON") from None
        value = document.get("timeout_secs") if isinstance(document, dict) else None
    else:
        value = request.POST.get("timeout_secs") or None
    if value is None:
        return None
    seconds = math.nan
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except ValueError:
            pass
    if not valid_drain_timeout(seconds):
        raise BadInput(f"timeout_secs must be {DRAIN_TIMEOUT_RULE}")
    return seconds


@require_POST
async def worker_action(request: HttpRequest, worker_id: str, action: str) -> HttpResponse:
    """Drain a connected worker or ask it to re-send its models."""
    user = await staff_user(request)
    if user is None:
        return forbidden()
    if not await user.ahas_perm(DRAIN_PERMISSION):
        return forbidden("you may not drain or refresh workers")
    rt = runtime.current()
    try:
        if action == "drain":
            try:  # before anything changes
                timeout = _drain_timeout(request)
            except BadInput as exc:
                return JsonResponse({"detail": str(exc)}, status=400)
            done = await rt.drain(
                worker_id, drain_secs=timeout, reason="drained from the dashboard"
            )
        elif action == "refresh":
            done = await rt.refresh(worker_id, reason="requested from the dashboard")
        else:
            return JsonResponse({"detail": f"unknown action '{action}'"}, status=404)
    except ClusterUnreachable as exc:
        return JsonResponse(
            {"detail": f"the other server processes cannot be reached: {exc}"}, status=503
        )
    if not done:
        return JsonResponse({"detail": f"no connected worker '{worker_id}'"}, status=404)
    logger.info("%s: %s by %s", action, worker_id, user.get_username())
    return JsonResponse({"ok": True, "worker_id": worker_id, "action": action})
