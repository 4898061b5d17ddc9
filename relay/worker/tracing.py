"""The worker's part of a request's trace (SPEC §17), when ``OTEL_*`` asks for traces.

The relay sends the context of its ``dispatch`` span as ``traceparent`` in the
``request`` frame's headers. With tracing on here (the same ``OTEL_*`` environment
as the server, :mod:`relay.wire.telemetry`; the OpenTelemetry packages are optional
on a GPU box), the worker records a ``backend call`` span under it, from forwarding
to the last byte, and hands the backend *its* context instead, so a backend that
traces (vLLM ``--otlp-traces-endpoint``) hangs its spans below the worker's; a
request the relay did not sample is not recorded here either, and the backend is
told so. With tracing off (:class:`NullWorkerTracing`) the relay's ``traceparent``
goes to the backend unchanged. Imports nothing from Django, and nothing of
OpenTelemetry unless tracing is on.

No hook raises: a failure is logged once and the request is forwarded untraced.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from relay.wire import telemetry
from relay.wire.protocol import Request, ResponseComplete

log = logging.getLogger("modelrelay.worker")


class CallTracer(Protocol):
    """The worker's tracing as a session sees it."""

    def start(self, request: Request) -> object:
        """``request`` is about to be forwarded: the span of its backend call (None: not
        traced). May replace the trace context in ``request.headers``."""
        ...

    def end(self, span: object, complete: ResponseComplete | None) -> None:
        """The call ended: with this completion, or aborted (None: cancelled, lost)."""
        ...

    async def aclose(self) -> None:
        """Export what is still buffered (the worker is exiting)."""
        ...


class NullWorkerTracing:
    """Tracing off: nothing recorded, the relay's context forwarded as it came."""

    __slots__ = ()

    def start(self, request: Request) -> None:
        return None

    def end(self, span: object, complete: ResponseComplete | None) -> None:
        pass

    async def aclose(self) -> None:
        pass


class WorkerTracing:
    """A :class:`CallTracer` recording ``backend call`` spans."""

    def __init__(self, traces: telemetry.Traces) -> None:
        self.traces = traces
        self.tracer = traces.tracer
        self._failures = 0

    def start(self, request: Request) -> Any:
        try:
            return self._start(request)
        except Exception:
            self._failed()
            return None

    def end(self, span: object, complete: ResponseComplete | None) -> None:
        if span is not None:
            try:
                self._end(span, complete)
            except Exception:
                self._failed()

    async def aclose(self) -> None:
        try:
            await asyncio.to_thread(self.traces.shutdown)
        except Exception:
            log.warning("flushing traces at exit failed", exc_info=True)

    def _start(self, request: Request) -> Any:
        headers = request.headers
        names = [k for k in headers if k.lower() in telemetry.CONTEXT_HEADERS]
        carrier = {k.lower(): headers[k] for k in names}
        span = self.tracer.start_span(
            "backend call",
            context=self.traces.extract(carrier),
            kind=self.traces.client_kind,
            attributes={
                "relay.request_id": request.request_id,
                "gen_ai.request.model": request.model,
                "url.path": request.endpoint_path,
                "relay.stream": request.is_streaming,
            },
        )
        context: dict[str, str] = {}
        self.traces.inject(context, span)
        for name in names:
            del headers[name]
        headers.update(context)
        return span

    def _end(self, span: Any, complete: ResponseComplete | None) -> None:
        if not span.is_recording():
            return
        if complete is None:
            span.set_attribute("relay.outcome", "aborted")
            span.set_status(self.traces.error)
        else:
            span.set_attribute("http.response.status_code", complete.status_code)
            counts = complete.token_counts
            if counts is not None and counts.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", counts.prompt_tokens)
            if counts is not None and counts.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", counts.completion_tokens)
            if complete.status_code >= 500:
                span.set_status(self.traces.error)
        span.end()

    def _failed(self) -> None:
        self._failures += 1
        if self._failures == 1:  # a bug to see once, never a request to break
            log.exception("recording a trace failed; later failures are not logged")


def from_environment(env: Mapping[str, str] | None = None) -> WorkerTracing | NullWorkerTracing:
    """The worker's tracing as ``OTEL_*`` configures it, or :class:`NullWorkerTracing`
    (off: the default)."""
    traces = telemetry.traces("modelrelay-worker", os.environ if env is None else env)
    return NullWorkerTracing() if traces is None else WorkerTracing(traces)
