"""A real OTLP/HTTP trace receiver on ``127.0.0.1:0`` for tests.

Accepts ``POST /v1/traces`` (protobuf, optionally gzip) as a collector does, decodes
each export with ``opentelemetry-proto`` and keeps every span; tests wait on a
condition over them (a :class:`threading.Condition`, never a sleep).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    #: W3C ``tracestate`` of the span's context ("" when none).
    trace_state: str
    start: int
    end: int
    attributes: dict[str, Any]
    error: bool


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.exports = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, export: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            trace_state=span.trace_state,
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == 2,
                        )
                    )
        with self._changed:
            self.spans.extend(spans)
            self.exports += 1
            self._changed.notify_all()

    def wait_for(
        self, check: Callable[[list[Span]], bool], timeout: float = 15.0, what: str = "spans"
    ) -> list[Span]:
        with self._changed:
            if not self._changed.wait_for(lambda: check(self.spans), timeout):
                names = sorted((s.service, s.name) for s in self.spans)
                raise AssertionError(f"timed out waiting for {what}; received {names}")
            return list(self.spans)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


def otel_env(receiver: Receiver, **extra: str) -> dict[str, str]:
    """The standard environment that sends a program's traces to ``receiver``, fast."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        **extra,
    }
