"""When tracing is on, and that it costs nothing when it is off (SPEC §17)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from relay.core.keycache import KeyCache, KnownKey
from relay.server.tracing import NullTracing, Tracing, from_environment
from relay.wire import protocol
from relay.wire.telemetry import Traces, exporters
from tests.corekit import attach, make_relay
from tests.live import ROOT

CHAT = "/v1/chat/completions"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_tracing_is_off_unless_the_standard_environment_asks_for_it() -> None:
    assert exporters({}) == []
    assert exporters({"OTEL_SERVICE_NAME": "relay"}) == []
    assert exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == ["otlp"]
    assert exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert exporters({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert exporters({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []
    disabled = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert exporters(disabled) == []
    assert isinstance(from_environment({}, clock=time.monotonic), NullTracing)


def test_with_tracing_off_no_tracing_module_is_loaded_by_server_or_worker() -> None:
    # (redis-py loads parts of the OpenTelemetry SDK for its own metrics when it is
    # installed; the relay's tracing must not add the tracer, propagator or exporter.)
    code = (
        "TRACING = ('opentelemetry.sdk.trace', 'opentelemetry.exporter', "
        "'opentelemetry.trace.propagation.tracecontext')\n"
        "import os, sys, django\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'modelrelay_site.settings'\n"
        "django.setup()\n"
        "import asyncio\n"
        "import relay.server.http.app, relay.server.runtime, worker\n"
        "async def main():\n"
        "    from relay.server.runtime import Runtime\n"
        "    rt = Runtime(asyncio.get_running_loop())\n"
        "    assert type(rt.tracing).__name__ == 'NullTracing' and rt.relay.tracer is rt.tracing\n"
        "    await rt.aclose()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith(TRACING)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


# -- the spans themselves, through the real core, into an in-memory exporter ----------


def traced_relay() -> tuple[Any, Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    relay = make_relay()
    keys = KeyCache("pepper")
    keys.replace({"mrk_team": KnownKey(id=1, key_hash="", name="team-a")})
    tracing = Tracing(Traces(provider, "modelrelay"), relay.loop.time, keys)
    relay.tracer = tracing
    return relay, tracing, exporter


def traced_submit(relay: Any, tracing: Tracing, key_id: int | None = None) -> Any:
    trace = tracing.begin([(b"authorization", b"Bearer mr_secret-key-value")], "POST", CHAT)
    request = relay.submit(
        model="m",
        endpoint_path=CHAT,
        flavor="openai",
        is_streaming=False,
        body='{"model":"m"}',
        headers={"content-type": "application/json"},
        key_id=key_id,
        trace=trace,
    )
    tracing.admitted(trace, request)
    return request


async def test_a_request_lost_with_its_worker_gets_a_second_dispatch_in_the_same_trace() -> None:
    relay, tracing, exporter = traced_relay()
    try:
        first, first_link = attach(relay, name="first")
        request = traced_submit(relay, tracing, key_id=1)
        [sent] = first_link.requests
        relay.detach_worker(first, "connection lost")  # no byte yet: requeued
        second, second_link = attach(relay, name="second")
        [again] = second_link.requests
        relay.on_complete(
            second,
            protocol.ResponseComplete(
                request_id=request.id,
                status_code=200,
                body="{}",
                token_counts=protocol.TokenCounts(prompt_tokens=3, completion_tokens=4),
            ),
        )
    finally:
        await relay.aclose()
    spans: dict[str, list[Any]] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    [root] = spans[f"POST {CHAT}"]
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {root.context.trace_id}
    lost, served = sorted(spans["dispatch"], key=lambda s: s.start_time)
    assert lost.attributes["relay.worker.name"] == "first"
    assert lost.attributes["relay.dispatch.outcome"] == "worker lost, requeued"
    assert served.attributes["relay.worker.name"] == "second"
    assert served.attributes["relay.dispatch.reason"] == "slot freed for the oldest waiting request"
    assert len(spans["queue wait"]) == 1  # the stint after the loss
    # Each worker got the context of its own dispatch span.
    for frame, span in ((sent, lost), (again, served)):
        assert frame.headers["traceparent"].split("-")[2] == format(span.context.span_id, "016x")
        assert frame.headers["content-type"] == "application/json"
    assert request.headers == {"content-type": "application/json"}  # the request's own stay
    assert root.attributes["relay.api_key.name"] == "team-a"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["relay.worker.name"] == "second"
    everything = [str(v) for s in exporter.get_finished_spans() for v in s.attributes.values()]
    assert not any("secret-key-value" in value for value in everything)


async def test_a_refused_request_ends_its_trace_with_the_error() -> None:
    relay, tracing, exporter = traced_relay()
    try:
        trace = tracing.begin([], "POST", CHAT)
        tracing.rejected(trace, 429, "queue_full", "m")
    finally:
        await relay.aclose()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans[f"POST {CHAT}"]
    assert root.attributes["http.response.status_code"] == 429
    assert root.attributes["relay.outcome"] == "queue_full"
    assert not root.status.is_ok and not spans["admission"].status.is_ok


# -- a tracing failure never reaches a request ------------------------------------------


class FailingTracer:
    """Wraps an SDK tracer: the ``at``-th call to it or to a method of its spans raises."""

    SPAN_METHODS = (
        "end",
        "get_span_context",
        "is_recording",
        "set_attribute",
        "set_attributes",
        "set_status",
    )

    def __init__(self, inner: Any, at: int) -> None:
        self.inner = inner
        self.at = at
        self.calls = 0

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("a bug in tracing")

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        self.tick()
        span = self.inner.start_span(*args, **kwargs)
        for name in self.SPAN_METHODS:  # (on the instance: propagation checks its type)
            setattr(span, name, self.failing(getattr(span, name)))
        return span

    def failing(self, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return method(*args, **kwargs)

        return call


async def one_request_failing_at(at: int) -> int:
    """A traced request whose tracer fails at its ``at``-th call (0: never), served to
    the end: asserts it went as without tracing; returns the calls it made."""
    relay, tracing, _ = traced_relay()
    failing = FailingTracer(tracing.tracer, at)
    tracing.tracer = failing
    try:
        worker, link = attach(relay)
        request = traced_submit(relay, tracing, key_id=1)
        [sent] = link.requests
        assert sent.headers["content-type"] == "application/json"
        relay.on_complete(
            worker,
            protocol.ResponseComplete(request_id=request.id, status_code=200, body="{}"),
        )
        assert (request.status, request.outcome) == (200, "ok")
        refused = tracing.begin([], "POST", CHAT)
        tracing.rejected(refused, 429, "queue_full", "m")
    finally:
        await relay.aclose()
    return failing.calls


async def test_a_failure_at_any_step_of_tracing_leaves_the_request_as_it_was() -> None:
    calls = await one_request_failing_at(0)
    assert calls > 10
    for at in range(1, calls + 1):
        await one_request_failing_at(at)


def test_a_failure_in_the_workers_tracing_leaves_the_backend_call_as_it_was() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from relay.worker.tracing import WorkerTracing

    tracing = WorkerTracing(Traces(TracerProvider(), "modelrelay-worker"))
    real = tracing.tracer
    at, calls = 0, None
    while calls is None or at <= calls:
        failing = FailingTracer(real, at)
        tracing.tracer = failing
        request = protocol.Request(
            request_id="r-1",
            model="m",
            endpoint_path=CHAT,
            is_streaming=False,
            body="{}",
            headers={"content-type": "application/json", "traceparent": TRACEPARENT},
        )
        span = tracing.start(request)
        tracing.end(span, protocol.ResponseComplete(request_id="r-1", status_code=200))
        assert request.headers["content-type"] == "application/json"
        assert request.headers["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]
        if calls is None:
            calls = failing.calls
        at += 1
