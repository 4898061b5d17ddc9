"""OpenTelemetry traces of relayed requests (SPEC §17), when ``OTEL_*`` asks for them.

:func:`from_environment` returns None unless the environment turns tracing on
(:mod:`relay.wire.telemetry`); the runtime then leaves ``Relay.tracer`` None and the
edges skip every call here, so with tracing off no OpenTelemetry module is loaded
and a request pays one ``is None`` test per hook.

One request, one trace, continuing the client's ``traceparent`` when it sent one:

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
the request path while it runs. Export happens in the SDK's batch thread.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from relay import __version__
from relay.core.state import RelayRequest, Worker
from relay.wire import telemetry

logger = logging.getLogger("relay.tracing")

Headers = list[tuple[bytes, bytes]]


class RequestTrace:
    """The spans of one request still open, and its clock offset."""

    __slots__ = ("admitted_ns", "context", "dispatch", "offset_ns", "root")

    def __init__(self, root: Any, context: Any, offset_ns: int) -> None:
        self.root = root
        self.context = context
        #: Wall-clock ns minus loop-clock ns at arrival.
        self.offset_ns = offset_ns
        self.admitted_ns: int | None = None
        self.dispatch: Any = None

    def wall(self, loop_time: float) -> int:
        return int(loop_time * 1e9) + self.offset_ns


class Tracing:
    """The relay's tracer; a :class:`relay.core.tracer.RequestTracer` for the core."""

    def __init__(self, provider: Any) -> None:
        api = importlib.import_module("opentelemetry.trace")
        self.provider = provider
        self.tracer = provider.get_tracer("modelrelay", __version__)
        self.propagator = telemetry.propagator()
        self._in_context = api.set_span_in_context
        self._server = api.SpanKind.SERVER
        self._error = api.Status(api.StatusCode.ERROR)
        self._failures = 0

    # -- the edges ------------------------------------------------------------

    def begin(self, headers: Headers, method: str, path: str, loop_now: float) -> RequestTrace:
        """A request arrived (call first thing): its root span, under the caller's
        ``traceparent`` when there is a valid one."""
        started = time.time_ns()
        carrier = {}
        for name, value in headers:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        root = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self._server,
            start_time=started,
            attributes={"http.request.method": method, "url.path": path},
        )
        return RequestTrace(root, self._in_context(root), started - int(loop_now * 1e9))

    def admitted(self, trace: RequestTrace, request: RelayRequest, key: str | None) -> None:
        """The relay accepted ``request`` (it may already be on a worker)."""
        attributes: dict[str, Any] = {
            "relay.request_id": request.id,
            "gen_ai.request.model": request.model,
            "relay.provider": request.provider,
            "relay.stream": request.is_streaming,
            "relay.service_class": request.service_class,
        }
        if key is not None:
            attributes["relay.api_key.name"] = key
        trace.root.set_attributes(attributes)
        if trace.admitted_ns is None:
            trace.admitted_ns = time.time_ns()
        self._span("admission", trace, trace.root.start_time, trace.admitted_ns)

    def rejected(self, trace: RequestTrace, status: int, outcome: str, model: str = "") -> None:
        """The relay refused the request before admitting it (or the client left)."""
        now = time.time_ns()
        self._span("admission", trace, trace.root.start_time, now, error=True)
        root = trace.root
        if model:
            root.set_attribute("gen_ai.request.model", model)
        root.set_attribute("http.response.status_code", status)
        root.set_attribute("relay.outcome", outcome)
        if status >= 500 or outcome != "cancelled":
            root.set_status(self._error)
        root.end(now)

    # -- the core's hooks (relay.core.tracer.RequestTracer) ---------------------

    def dispatched(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        trace = request.trace
        if not isinstance(trace, RequestTrace):
            return request.headers  # not traced (a batch line, a legacy client)
        try:
            return self._dispatched(trace, request, worker, now)
        except Exception:
            self._failed()
            return request.headers

    def finished(self, request: RelayRequest) -> None:
        trace = request.trace
        if isinstance(trace, RequestTrace):
            try:
                self._finished(trace, request)
            except Exception:
                self._failed()

    # -- details ----------------------------------------------------------------

    def _dispatched(
        self, trace: RequestTrace, request: RelayRequest, worker: Worker, now: float
    ) -> dict[str, str]:
        at = trace.wall(now)
        if trace.admitted_ns is None:
            trace.admitted_ns = at  # chosen within admission: nothing to wait for
        if trace.dispatch is not None:  # lost its worker before any byte: requeued
            trace.dispatch.set_attribute("relay.dispatch.outcome", "worker lost, requeued")
            trace.dispatch.set_status(self._error)
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
        self.propagator.inject(headers, context=self._in_context(span))
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
            root.set_status(self._error)
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
            span.set_status(self._error)
        span.end(max(start, end))

    def _failed(self) -> None:
        self._failures += 1
        if self._failures == 1:  # a bug to see once, never a request to break
            logger.exception("recording a trace failed; later failures are not logged")

    def shutdown(self) -> None:
        """Export what is still buffered (server shutdown)."""
        try:
            self.provider.shutdown()
        except Exception:
            logger.warning("flushing traces at shutdown failed", exc_info=True)


def from_environment(env: Mapping[str, str] | None = None) -> Tracing | None:
    """Tracing as ``OTEL_*`` configures it, or None (off: the default)."""
    provider = telemetry.tracer_provider("modelrelay", os.environ if env is None else env)
    return None if provider is None else Tracing(provider)
