"""Whether and how both programs export OpenTelemetry traces (SPEC §17).

Off by default. On when the standard environment asks for traces:
``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``, or it is unset and an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` turns everything off. Everything else — endpoint,
headers, timeouts, sampler (``OTEL_TRACES_SAMPLER``, parent-based always-on by
default), batch sizes and delays (``OTEL_BSP_*``), service name and resource
attributes — is read by the OpenTelemetry SDK itself. The exporter speaks OTLP over
HTTP (protobuf); the gRPC exporter is not installed.

The SDK is imported only by :func:`traces` (and :func:`tracer_provider`), called once
at start when tracing is on: with it off, nothing of OpenTelemetry is loaded. It is
imported by name (like uvloop in ``worker.py``) because the worker treats it as
optional. Both programs record their spans through :class:`Traces`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from relay import __version__

logger = logging.getLogger("relay.tracing")

_TRUE = {"1", "true", "yes", "on"}

#: The W3C trace context headers (lower case), both ways.
CONTEXT_HEADERS = ("traceparent", "tracestate")


def exporters(env: Mapping[str, str]) -> list[str]:
    """The trace exporters the environment asks for ([] when tracing is off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return []
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return [e.strip() for e in named.split(",") if e.strip() and e.strip() != "none"]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return ["otlp"] if endpoint else []


def tracer_provider(service_name: str, env: Mapping[str, str]) -> Any | None:
    """A started SDK ``TracerProvider`` exporting as the environment says, or None
    (tracing off, or the SDK missing: said once in the log)."""
    wanted = exporters(env)
    if not wanted:
        return None
    try:
        sdk_trace = importlib.import_module("opentelemetry.sdk.trace")
        export = importlib.import_module("opentelemetry.sdk.trace.export")
        resources = importlib.import_module("opentelemetry.sdk.resources")
    except ImportError as exc:
        logger.warning(
            "OTEL_* asks for traces but the OpenTelemetry SDK is not installed (%s): "
            "no traces; pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http",
            exc,
        )
        return None
    resource = resources.Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(resources.Resource({"service.name": service_name}))
    provider = sdk_trace.TracerProvider(resource=resource)
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    for name in wanted:
        if name == "otlp":
            if protocol and protocol != "http/protobuf":
                logger.warning(
                    "OTLP protocol %r is not supported here; using http/protobuf", protocol
                )
            module = importlib.import_module(
                "opentelemetry.exporter.otlp.proto.http.trace_exporter"
            )
            exporter = module.OTLPSpanExporter()
        elif name == "console":
            exporter = export.ConsoleSpanExporter()
        else:
            logger.warning("unknown OTEL_TRACES_EXPORTER %r ignored", name)
            continue
        # Spans are exported from the processor's own thread, in batches: never on the
        # event loop.
        provider.add_span_processor(export.BatchSpanProcessor(exporter))
    logger.info("tracing on: %s exporter(s), service %s", ",".join(wanted), service_name)
    return provider


def propagator() -> Any:
    """W3C trace context (``traceparent`` / ``tracestate``)."""
    module = importlib.import_module("opentelemetry.trace.propagation.tracecontext")
    return module.TraceContextTextMapPropagator()


class Traces:
    """What one program records its spans with, built once at start when tracing is on:
    the SDK provider's tracer (named after the program), the W3C propagator, the span
    kinds and the error status. Holds no per-request state."""

    def __init__(self, provider: Any, name: str) -> None:
        api = importlib.import_module("opentelemetry.trace")
        self.provider = provider
        self.tracer = provider.get_tracer(name, __version__)
        self.propagator = propagator()
        self.in_context = api.set_span_in_context
        self.server_kind = api.SpanKind.SERVER
        self.client_kind = api.SpanKind.CLIENT
        self.error = api.Status(api.StatusCode.ERROR)

    def extract(self, carrier: Mapping[str, str]) -> Any:
        """The remote context ``carrier`` (``traceparent``/``tracestate``) holds, as a
        parent for ``start_span``; None (a new trace) when it holds none."""
        return self.propagator.extract(carrier) if carrier else None

    def inject(self, headers: MutableMapping[str, str], span: Any) -> None:
        """Set ``span``'s context in ``headers`` (``traceparent``, and ``tracestate``
        when the trace has one): a child of ``span`` continues the trace from there."""
        self.propagator.inject(headers, context=self.in_context(span))

    def shutdown(self) -> None:
        """Export what is still buffered; blocks (run it off the event loop)."""
        self.provider.shutdown()


def traces(service_name: str, env: Mapping[str, str]) -> Traces | None:
    """:class:`Traces` as the environment configures them, or None (tracing off)."""
    provider = tracer_provider(service_name, env)
    return None if provider is None else Traces(provider, service_name)
