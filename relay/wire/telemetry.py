"""Whether and how both programs export OpenTelemetry traces (SPEC §17).

Off by default. On when the standard environment asks for traces:
``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``, or it is unset and an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` turns everything off. Everything else — endpoint,
headers, timeouts, sampler (``OTEL_TRACES_SAMPLER``, parent-based always-on by
default), batch sizes and delays (``OTEL_BSP_*``), service name and resource
attributes — is read by the OpenTelemetry SDK itself. The exporter speaks OTLP over
HTTP (protobuf); the gRPC exporter is not installed.

The SDK is imported only by :func:`tracer_provider`, called once at start when
tracing is on: with it off, nothing of OpenTelemetry is loaded. It is imported by
name (like uvloop in ``worker.py``) because the worker treats it as optional.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("relay.tracing")

_TRUE = {"1", "true", "yes", "on"}


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
