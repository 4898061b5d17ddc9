"""OpenTelemetry traces of relayed requests (SPEC §17), when ``OTEL_*`` asks for them.

:func:`from_environment` returns :class:`NullTracing` unless the environment turns
tracing on (:mod:`relay.wire.telemetry`): the edges and the core call every hook
unconditionally, and with tracing off each is a method call that does nothing, with
no OpenTelemetry module loaded.

One request, one trace, continuing the client's ``traceparent`` when it sent one and
``OTEL_TRUST_INCOMING`` is true (the default: the client's context then decides whether
the request is recorded, and its ``tracestate`` travels into the spans and on to the
backend); with it false every request starts a new trace at the edge and the client's
context is ignored:

- a root span ``POST /v1/...`` (kind server) from arrival to the last byte, with the
  request id, model, provider, API key *name* (never the secret), priority class,
  final status, outcome and token counts;
- ``admission``: arrival until the relay accepted it (keys, limits, parsing);
- ``queue wait``: each stint in the queue (a requeued request has several);
- ``dispatch``: from the moment a worker was chosen until the request ended on it,
  with the worker, its load and why it was chosen (least load, a slot freed for the
  oldest waiting request, a preemption, a cluster placement). Its context is sent to
  the worker as ``traceparent`` in the ``request`` frame's headers: the worker's span
  around its backend call is its child, and the backend (vLLM with
  ``--otlp-traces-endpoint``) joins the same trace;
- ``first byte``: dispatch until the worker's first byte;
- ``completion``: first byte until the end, with status and token counts.

In cluster mode the process the client reached places a request on another process's
worker through the peer link (:mod:`relay.server.cluster.proxy`), which carries the
dispatch span's ``traceparent``; that process continues the trace with a root span of
its own (``placed``) and its own dispatch to the worker.

Spans other than the root and the dispatch are recorded when the request ends, with
the times the core noted (its loop clock, converted to wall time): no extra work on
the request path while it runs. Export happens in the SDK's batch thread. A request
the sampler leaves out gets a root that records nothing and no other span; its context
(flagged not sampled) still goes to the worker, so the worker and the backend leave it
out too. No hook raises (a request may already run on a worker when one is called): a
failure is logged once and the request goes on untraced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from relay.core.keycache import KeyCache
from relay.core.keystats import key_name
from relay.core.state import RelayRequest, Worker
from relay.core.tracer import NullTracer, RequestTracer
from relay.wire import telemetry

logger = logging.getLogger("relay.tracing")

Headers = list[tuple[bytes, bytes]]

_CONTEXT_HEADERS = frozenset(name.encode() for name in telemetry.CONTEXT_HEADERS)


class EdgeTracer(RequestTracer, Protocol):
    """The tracer as the HTTP edge sees it: the core's hooks, and the edge's own.

    ``trace`` is what :meth:`begin` returned, handed to ``submit`` and back to these
    hooks (None: the request is not traced). No hook raises.
    """

    def begin(self, headers: Headers, method: str, path: str, *, peer: bool = False) -> object:
        """A request arrived (call first thing): its trace. ``peer``: another process
        of the cluster placed it here, and its context is always continued."""
        ...

    def admitted(self, trace: object, request: RelayRequest) -> None:
        """The relay accepted ``request`` (it may already be on a worker)."""
        ...

    def rejected(self, trace: object, status: int, outcome: str, model: str = "") -> None:
        """The relay refused the request before admitting it (or the client left)."""
        ...

    async def aclose(self) -> None:
        """Export what is still buffered (server shutdown)."""
        ...


class NullTracing(NullTracer):
    """Tracing off: every hook does nothing and costs a method call; nothing of
    OpenTelemetry is loaded."""

    __slots__ = ()

    def begin(self, headers: Headers, method: str, path: str, *, peer: bool = False) -> None:
        return None

    def admitted(self, trace: object, request: RelayRequest) -> None:
        pass

    def rejected(self, trace: object, status: int, outcome: str, model: str = "") -> None:
        pass

    async def aclose(self) -> None:
        pass


class RequestTrace:
    """The spans of one request still open, and its clock offset."""

    __slots__ = (
        "admitted_ns",
        "context",
        "dispatch",
        "offset_ns",
        "recording",
        "root",
        "started_ns",
    )

    def __init__(self, root: Any, context: Any, started_ns: int, offset_ns: int) -> None:
        self.root = root
        #: The root's context, parent of every other span; None when the sampler does
        #: not record the request (only the root exists then, recording nothing).
        self.context = context
        self.recording: bool = context is not None
        #: Wall-clock ns at arrival (a root that records nothing has no start time).
        self.started_ns = started_ns
        #: Wall-clock ns minus loop-clock ns at arrival.
        self.offset_ns = offset_ns
        self.admitted_ns: int | None = None
        self.dispatch: Any = None

    def wall(self, loop_time: float) -> int:
        return int(loop_time * 1e9) + self.offset_ns


class Tracing:
    """The relay's tracer (an :class:`EdgeTracer`), while tracing is on.

    ``clock`` is the core's loop clock (the times it notes on requests); ``keys`` names
    API keys; ``trust_incoming`` (``OTEL_TRUST_INCOMING``) whether a client's context
    is continued.
    """

    def __init__(
        self,
        traces: telemetry.Traces,
        clock: Callable[[], float],
        keys: KeyCache | None = None,
        *,
        trust_incoming: bool = True,
    ) -> None:
        self.traces = traces
        self.tracer = traces.tracer
        self.clock = clock
        self.keys = keys
        self.trust_incoming = trust_incoming
        self._failures = 0

    # -- the edges ------------------------------------------------------------

    def begin(
        self, headers: Headers, method: str, path: str, *, peer: bool = False
    ) -> RequestTrace | None:
        try:
            return self._begin(headers, method, path, peer)
        except Exception:
            self._failed()
            return None

    def admitted(self, trace: object, request: RelayRequest) -> None:
        if isinstance(trace, RequestTrace) and trace.recording:
            try:
                self._admitted(trace, request)
            except Exception:
                self._failed()

    def rejected(self, trace: object, status: int, outcome: str, model: str = "") -> None:
        if isinstance(trace, RequestTrace) and trace.recording:
            try:
                self._rejected(trace, status, outcome, model)
            except Exception:
                self._failed()

    # -- the core's hooks (relay.core.tracer.RequestTracer) ---------------------

    def dispatched(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        trace = request.trace
        if not isinstance(trace, RequestTrace):
            return request.headers  # not traced (a batch line, a legacy client)
        try:
            if not trace.recording:  # the worker and the backend are told so
                headers = dict(request.headers)
                self.traces.inject(headers, trace.root)
                return headers
            return self._dispatched(trace, request, worker, now)
        except Exception:
            self._failed()
            return request.headers

    def hedged(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        trace = request.trace
        if not isinstance(trace, RequestTrace):
            return request.headers
        try:
            headers = dict(request.headers)
            dispatch = trace.dispatch if trace.recording else None
            if dispatch is not None:
                # The second attempt continues the same dispatch: the worker that
                # answers first is the one the trace goes on with.
                dispatch.add_event(
                    "hedged",
                    {"relay.worker.name": worker.name, "relay.worker.id": worker.id},
                    timestamp=trace.wall(now),
                )
            self.traces.inject(headers, dispatch if dispatch is not None else trace.root)
            return headers
        except Exception:
            self._failed()
            return request.headers

    def finished(self, request: RelayRequest) -> None:
        trace = request.trace
        if isinstance(trace, RequestTrace) and trace.recording:
            try:
                self._finished(trace, request)
            except Exception:
                self._failed()

    # -- details ----------------------------------------------------------------

    def _begin(self, headers: Headers, method: str, path: str, peer: bool) -> RequestTrace:
        started = time.time_ns()
        loop_now = self.clock()
        parent = None
        if peer or self.trust_incoming:
            carrier = {
                name.decode(): value.decode("latin-1")
                for name, value in headers
                if name in _CONTEXT_HEADERS
            }
            parent = self.traces.extract(carrier)
        root = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self.traces.server_kind,
            start_time=started,
            attributes={"http.request.method": method, "url.path": path},
        )
        # A root the sampler drops records nothing, and neither would its children
        # (every standard sampler decides a trace's spans alike): none are made.
        context = self.traces.in_context(root) if root.is_recording() else None
        return RequestTrace(root, context, started, started - int(loop_now * 1e9))

    def _admitted(self, trace: RequestTrace, request: RelayRequest) -> None:
        attributes: dict[str, Any] = {
            "relay.request_id": request.id,
            "gen_ai.request.model": request.model,
            "relay.provider": request.provider,
            "relay.stream": request.is_streaming,
            "relay.service_class": request.service_class,
        }
        if request.key_id is not None and self.keys is not None:
            attributes["relay.api_key.name"] = key_name(self.keys, request.key_id)
        trace.root.set_attributes(attributes)
        if trace.admitted_ns is None:
            trace.admitted_ns = time.time_ns()
        self._span("admission", trace, trace.started_ns, trace.admitted_ns)

    def _rejected(self, trace: RequestTrace, status: int, outcome: str, model: str) -> None:
        now = time.time_ns()
        self._span("admission", trace, trace.started_ns, now, error=True)
        root = trace.root
        if model:
            root.set_attribute("gen_ai.request.model", model)
        root.set_attribute("http.response.status_code", status)
        root.set_attribute("relay.outcome", outcome)
        if status >= 500 or outcome != "cancelled":
            root.set_status(self.traces.error)
        root.end(now)

    def _dispatched(
        self, trace: RequestTrace, request: RelayRequest, worker: Worker, now: float
    ) -> dict[str, str]:
        at = trace.wall(now)
        if trace.admitted_ns is None:
            trace.admitted_ns = at  # chosen within admission: nothing to wait for
        if trace.dispatch is not None:  # lost its worker before any byte: requeued
            trace.dispatch.set_attribute("relay.dispatch.outcome", "worker lost, requeued")
            trace.dispatch.set_status(self.traces.error)
            trace.dispatch.end(at)
        if request.enqueued_at is not None:
            self._span(
                "queue wait",
                trace,
                trace.wall(request.enqueued_at),
                at,
                {"relay.service_class": request.service_class},
            )
        why = request.why or self._why(request, worker)
        request.why = ""
        span = self.tracer.start_span(
            "dispatch",
            context=trace.context,
            start_time=at,
            attributes={
                "relay.request_id": request.id,
                "relay.worker.name": worker.name,
                "relay.worker.id": worker.id,
                "relay.worker.provider": worker.provider,
                "relay.worker.load": worker.load,
                "relay.worker.max_concurrent": worker.max_concurrent,
                "relay.dispatch.reason": why,
                "relay.requeues": request.requeues,
            },
        )
        trace.dispatch = span
        headers = dict(request.headers)
        self.traces.inject(headers, span)
        return headers

    @staticmethod
    def _why(request: RelayRequest, worker: Worker) -> str:
        if request.relay_role == "worker":
            return "placed here by the process the client reached"
        if worker.remote:
            return "cluster placement on another process's worker"
        if request.cluster_seq:
            return "cluster placement (least load, this process's workers first)"
        if request.enqueued_at is not None:
            return "slot freed for the oldest waiting request"
        return "least load"

    def _finished(self, trace: RequestTrace, request: RelayRequest) -> None:
        end = trace.wall(request.finished_at) if request.finished_at is not None else time.time_ns()
        if request.enqueued_at is not None:  # ended while queued (timeout, cancel)
            self._span("queue wait", trace, trace.wall(request.enqueued_at), end)
        counts = request.token_counts
        tokens: dict[str, int] = {}
        if counts is not None:
            for name, value in (
                ("gen_ai.usage.input_tokens", counts.prompt_tokens),
                ("gen_ai.usage.output_tokens", counts.completion_tokens),
            ):
                if value is not None:
                    tokens[name] = value
        dispatch = trace.dispatch
        if dispatch is not None:
            started = trace.wall(request.assigned_at)
            first = request.first_byte_at
            if first is not None:
                first_ns = trace.wall(first)
                self._span("first byte", trace, started, first_ns)
                self._span(
                    "completion",
                    trace,
                    first_ns,
                    end,
                    {"http.response.status_code": request.status or 0, **tokens},
                )
            dispatch.set_attribute("relay.dispatch.outcome", request.outcome or "")
            dispatch.end(end)
            trace.dispatch = None
        root = trace.root
        attributes: dict[str, Any] = {
            "http.response.status_code": request.status or 0,
            "relay.outcome": request.outcome or "",
            **tokens,
        }
        if request.worker_name:
            attributes["relay.worker.name"] = request.worker_name
        root.set_attributes(attributes)
        if (request.status or 0) >= 500 or request.outcome not in ("ok", "upstream_error"):
            root.set_status(self.traces.error)
        root.end(end)

    def _span(
        self,
        name: str,
        trace: RequestTrace,
        start: int,
        end: int,
        attributes: dict[str, Any] | None = None,
        error: bool = False,
    ) -> None:
        """A span already over: all it says is given here (an ended span takes nothing)."""
        span = self.tracer.start_span(
            name, context=trace.context, start_time=start, attributes=attributes
        )
        if error:
            span.set_status(self.traces.error)
        span.end(max(start, end))

    def _failed(self) -> None:
        self._failures += 1
        if self._failures == 1:  # a bug to see once, never a request to break
            logger.exception("recording a trace failed; later failures are not logged")

    def shutdown(self) -> None:
        """Export what is still buffered (blocks)."""
        try:
            self.traces.shutdown()
        except Exception:
            logger.warning("flushing traces at shutdown failed", exc_info=True)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)


def from_environment(
    env: Mapping[str, str] | None = None,
    *,
    clock: Callable[[], float],
    keys: KeyCache | None = None,
    trust_incoming: bool = True,
) -> Tracing | NullTracing:
    """Tracing as ``OTEL_*`` configures it (see :class:`Tracing` for the rest), or
    :class:`NullTracing` (off: the default)."""
    traces = telemetry.traces("modelrelay", os.environ if env is None else env)
    if traces is None:
        return NullTracing()
    return Tracing(traces, clock, keys, trust_incoming=trust_incoming)
