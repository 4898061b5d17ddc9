"""The inference routes: a client request admitted, relayed and answered; and a request
another server process placed on one of this process's workers (cluster mode)."""

from __future__ import annotations

import math

from relay.core import classes, deadlines
from relay.core.background import backend_body
from relay.server import runtime
from relay.server.cluster.proxy import (
    CLASS_HEADER,
    KEY_HEADER,
    LEASE_HEADER,
    LIFETIME_HEADER,
    RESUME_HEADER,
)
from relay.server.http import resume
from relay.server.http.request import (
    ClientGone,
    before_body,
    header,
    read_body,
    read_head,
)
from relay.server.http.respond import respond
from relay.server.http.send import Receive, Scope, Send, send_error, send_simple
from relay.wire import logrecord
from relay.wire.errors import BadRequest, Flavor, RelayError, WorkerUnavailable
from relay.wire.headers import forwarded_request_headers

LEASE_HEADER_B = LEASE_HEADER.encode()
LIFETIME_HEADER_B = LIFETIME_HEADER.encode()
KEY_HEADER_B = KEY_HEADER.encode()
CLASS_HEADER_B = CLASS_HEADER.encode()
RESUME_HEADER_B = RESUME_HEADER.encode()


async def inference(scope: Scope, receive: Receive, send: Send, flavor: Flavor) -> None:
    rt = runtime.current()
    cors = rt.cors.headers(header(scope, b"origin"))
    method = scope["method"]
    if method == "OPTIONS" and cors is not None:
        await send_simple(send, 204, cors + rt.cors.preflight(), b"")
        return
    relay = rt.relay
    path = scope["path"]
    tracing = rt.tracing
    trace = tracing.begin(scope["headers"], method, path)
    await rt.ready()  # providers and keys loaded (instant after the first request)
    try:
        key_id, relay_auth_headers = before_body(rt, method, path, flavor, scope["headers"])
        # Bounded and checked before the body is read (SPEC §21).
        stated_deadline = deadlines.parse(header(scope, deadlines.HEADER))
        raw = await read_body(receive, rt.config.max_request_bytes)
        try:
            body = raw.decode()
        except UnicodeDecodeError:
            raise BadRequest("Request body must be UTF-8 encoded JSON") from None
        head = read_head(raw)
        model, stream, tier = head.model, head.stream, head.service_tier
        if len(model) > rt.config.max_model_name_len:
            raise BadRequest(f"'model' is longer than {rt.config.max_model_name_len} characters")
        wanted = classes.asked(header(scope, b"x-priority"), tier)
        # SPEC §18: None unless the request asks for its response to outlive it.
        plan = resume.asked(scope, path, head, key_id, flavor)
        if plan is not None and plan.entry.kind == "background":
            body, stream = backend_body(raw).decode(), True
    except ClientGone:
        tracing.rejected(trace, 499, "cancelled")
        return
    except RelayError as err:
        relay.record_rejection(err, "", path, False, None)
        tracing.rejected(trace, err.status, err.outcome)
        await send_error(send, err, flavor, cors)
        return
    if rt.placement is not None and not relay.knows(model):
        # A worker may have registered a moment ago at another process.
        await rt.placement.learn(model)
    ticket = None
    if key_id is not None:
        try:  # the key's limits (SPEC §13): one Redis round trip at most
            ticket = await rt.admit(key_id, model, head.prompt.reservation)
        except RelayError as err:
            relay.record_rejection(err, model, path, stream, key_id)
            tracing.rejected(trace, err.status, err.outcome, model)
            await send_error(send, err, flavor, cors)
            return
    if plan is not None:
        try:
            await rt.streams.open(plan.entry, replace=plan.replace)
        except RelayError as err:
            if ticket is not None:
                ticket.close()
            relay.record_rejection(err, model, path, stream, key_id)
            tracing.rejected(trace, err.status, err.outcome, model)
            await send_error(send, err, flavor, cors)
            return
    service_class = rt.service_class(key_id, wanted)
    try:
        request = relay.submit(
            model=model,
            endpoint_path=path,
            flavor=flavor,
            is_streaming=stream,
            body=body,
            headers=forwarded_request_headers(scope["headers"], exclude=relay_auth_headers),
            key_id=key_id,
            ticket=ticket,
            service_class=service_class,
            trace=trace,
            prompt=head.prompt,
            session=_session(scope, rt.config.affinity.session_header),
            deadline_ms=rt.deadline(key_id, service_class, stated_deadline),
        )
    except BaseException as exc:
        # Until submit returns the ticket is ours: free the key's slot on every way
        # out, a bug included (the application answers that one with a 500).
        if ticket is not None:
            ticket.close()
        if plan is not None:
            await rt.streams.forget(plan.entry)
        failed = exc if isinstance(exc, RelayError) else None
        status, outcome = (500, "error") if failed is None else (failed.status, failed.outcome)
        tracing.rejected(trace, status, outcome, model)
        if failed is None:
            raise
        await send_error(send, failed, flavor, cors)  # already counted by the core
        return
    tracing.admitted(trace, request)
    logrecord.request_id.set(request.id)  # every line this task logs names it
    if plan is None:
        await respond(relay, request, receive, send, cors or [])
    else:
        await resume.serve(rt, plan, request, receive, send, cors or [])


def _session(scope: Scope, name: str) -> str | None:
    """The session header's value (SPEC §14); not forwarded to the backend."""
    value = header(scope, name.encode("latin-1"))
    return value.decode("latin-1") if value else None


async def placed_here(scope: Scope, receive: Receive, send: Send, flavor: Flavor) -> None:
    """A request another server process placed on one of our workers (cluster mode,
    see :mod:`relay.server.cluster.proxy`): authenticated by the cluster token
    (:func:`relay.server.http.early.internal`, checked by the caller), already
    admitted there (keys, limits, aliases), its slot reserved under a lease."""
    rt = runtime.current()
    placement = rt.placement
    assert placement is not None  # internal() holds only in cluster mode
    relay = rt.relay
    path = scope["path"]
    tracing = rt.tracing
    # Continues the trace of the process the client reached, whatever OTEL_TRUST_INCOMING.
    trace = tracing.begin(scope["headers"], "placed", path, peer=True)
    worker_id, _, lease = (header(scope, LEASE_HEADER_B) or b"").decode().partition(" ")
    try:
        lifetime = float(header(scope, LIFETIME_HEADER_B) or b"0")
        key = header(scope, KEY_HEADER_B)
        key_id = int(key) if key is not None and key.isdigit() else None
        service_class, _, preempted = (header(scope, CLASS_HEADER_B) or b"").decode().partition(" ")
        raw = await read_body(receive, rt.config.max_request_bytes)
        head = read_head(raw)
        model, stream = head.model, head.stream
        resumable = header(scope, RESUME_HEADER_B)
        kept = None if resumable is None else await resume.placed_entry(rt, resumable)
        request = relay.submit_pinned(
            worker_id=worker_id,
            lease=lease,
            model=model,
            endpoint_path=path,
            flavor=flavor,
            is_streaming=stream,
            body=raw.decode(),
            headers=forwarded_request_headers(scope["headers"]),
            key_id=key_id,
            # NaN and infinities never reach a deadline (min() keeps a leading NaN).
            lifetime=min(lifetime, rt.config.request_timeout)
            if math.isfinite(lifetime)
            else rt.config.request_timeout,
            service_class=service_class if service_class in classes.RANK else classes.DEFAULT,
            preemptions=int(preempted) if preempted.isdigit() and len(preempted) < 6 else 0,
            trace=trace,
            prompt=head.prompt,
        )
    except ClientGone:
        placement.release(worker_id, lease)
        tracing.rejected(trace, 499, "cancelled")
        return
    except (RelayError, ValueError, UnicodeDecodeError) as exc:
        worker = relay.registry.workers.get(worker_id)
        if isinstance(exc, WorkerUnavailable) and worker is not None and relay.full(worker):
            placement.refused(worker_id, lease)  # Redis lost reservations: resync first
        else:
            placement.release(worker_id, lease)
        err = exc if isinstance(exc, RelayError) else BadRequest("Malformed internal request")
        tracing.rejected(trace, err.status, err.outcome)
        await send_error(send, err, flavor)
        return
    tracing.admitted(trace, request)
    placement.extend(worker_id, lease, request)
    logrecord.request_id.set(request.id)
    if kept is None:
        await respond(relay, request, receive, send, [])
    else:
        await resume.serve_placed(rt, kept, request, receive, send)
