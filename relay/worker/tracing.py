"""The worker's part of a request's trace (SPEC §17), when ``OTEL_*`` asks for traces.

The relay sends the context of its ``dispatch`` span as ``traceparent`` in the
``request`` frame's headers. With tracing on here (the same ``OTEL_*`` environment
as the server, :mod:`relay.wire.telemetry`; the OpenTelemetry packages are optional
on a GPU box), the worker records a ``backend call`` span under it, from forwarding
to the last byte, and hands the backend *its* context instead, so a backend that
traces (vLLM ``--otlp-traces-endpoint``) hangs its spans below the worker's. With
tracing off the relay's ``traceparent`` goes to the backend unchanged. Imports
nothing from Django, and nothing of OpenTelemetry unless tracing is on.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from relay import __version__
from relay.wire import telemetry
from relay.wire.protocol import Request, ResponseComplete

_CONTEXT_HEADERS = ("traceparent", "tracestate")


class WorkerTracing:
    def __init__(self, provider: Any) -> None:
        api = importlib.import_module("opentelemetry.trace")
        self.provider = provider
        self.tracer = provider.get_tracer("modelrelay-worker", __version__)
        self.propagator = telemetry.propagator()
        self._in_context = api.set_span_in_context
        self._client = api.SpanKind.CLIENT
        self._error = api.Status(api.StatusCode.ERROR)

    def start(self, request: Request) -> Any:
        """The span of ``request``'s backend call; its context replaces the relay's in
        the headers the backend gets."""
        headers = request.headers
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in _CONTEXT_HEADERS}
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            "backend call",
            context=parent,
            kind=self._client,
            attributes={
                "relay.request_id": request.request_id,
                "gen_ai.request.model": request.model,
                "url.path": request.endpoint_path,
                "relay.stream": request.is_streaming,
            },
        )
        for name in [k for k in headers if k.lower() in _CONTEXT_HEADERS]:
            del headers[name]
        self.propagator.inject(headers, context=self._in_context(span))
        return span

    def end(self, span: Any, complete: ResponseComplete | None) -> None:
        """The call ended: with this completion, or aborted (None: cancelled, lost)."""
        if complete is None:
            span.set_attribute("relay.outcome", "aborted")
            span.set_status(self._error)
        else:
            span.set_attribute("http.response.status_code", complete.status_code)
            counts = complete.token_counts
            if counts is not None and counts.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", counts.prompt_tokens)
            if counts is not None and counts.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", counts.completion_tokens)
            if complete.status_code >= 500:
                span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()


def from_environment(env: Mapping[str, str] | None = None) -> WorkerTracing | None:
    """The worker's tracing as ``OTEL_*`` configures it, or None (off: the default)."""
    provider = telemetry.tracer_provider("modelrelay-worker", os.environ if env is None else env)
    return None if provider is None else WorkerTracing(provider)
