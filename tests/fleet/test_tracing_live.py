"""OpenTelemetry traces end to end (SPEC §17): a live server and the real worker.py export
to a real OTLP/HTTP receiver on 127.0.0.1; one trace per request, continuing the
client's ``traceparent`` through admission, queue, dispatch, the worker and the backend
(or not, with ``OTEL_TRUST_INCOMING=false``); across two cluster processes too."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clusterkit import cluster, knows
from tests.fleet.otlp import Span, otel_env, otlp_receiver
from tests.live import live_server
from tests.test_e2e import poll, routable, running_worker
from tests.upstream import upstream_in_thread

pytestmark = pytest.mark.live

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "client=b7ad6b7169203331"
SERVER_KIND = 2


def of_trace(spans: list[Span], trace_id: str) -> dict[str, list[Span]]:
    named: dict[str, list[Span]] = {}
    for span in spans:
        if span.trace_id == trace_id:
            named.setdefault(span.name, []).append(span)
    return named


def chat(url: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    document = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(url + CHAT, json=document, headers=headers or {}, timeout=15)


def test_one_trace_per_request_from_the_clients_context_through_queue_worker_and_backend(
    tmp_path: Path,
) -> None:
    with (
        otlp_receiver() as receiver,
        upstream_in_thread() as up,
        live_server(tmp_path / "server", **otel_env(receiver)) as server,
        running_worker(
            server,
            up.url,
            "--max-concurrent",
            "1",
            "--no-backend-metrics",
            env={**os.environ, **otel_env(receiver)},
        ),
    ):
        poll(lambda: routable(server), what="the worker's model")
        # The only slot is taken, so the traced request waits in the queue.
        results: dict[str, httpx.Response] = {}
        slow = threading.Thread(
            target=lambda: results.update(slow=chat(server.url, mock={"first_byte_delay": 0.3}))
        )
        slow.start()
        up.call(lambda: up.upstream.wait_requests(1, CHAT))
        traced = chat(
            server.url, {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}, stream=True
        )
        slow.join(15)
        assert traced.status_code == 200 and results["slow"].status_code == 200

        def complete(spans: list[Span]) -> bool:
            calls = [s for s in spans if s.name == "backend call"]
            roots = [s for s in spans if s.name == f"POST {CHAT}"]
            return len(calls) == 2 and len(roots) == 2

        spans = receiver.wait_for(complete, what="both requests' spans")

    # One trace per request: the client's, and a new one for the request without context.
    roots = [s for s in spans if s.name == f"POST {CHAT}"]
    assert len({r.trace_id for r in roots}) == 2
    trace = of_trace(spans, CLIENT_TRACE)
    [root] = trace[f"POST {CHAT}"]
    assert root.parent_id == CLIENT_SPAN and root.kind == SERVER_KIND
    assert root.service == "modelrelay"
    assert root.trace_state == TRACESTATE  # the client's, carried through
    assert root.attributes["relay.request_id"].startswith("r-")
    assert root.attributes["gen_ai.request.model"] == "mock-model"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["relay.outcome"] == "ok"
    assert root.attributes["gen_ai.usage.output_tokens"] == up.upstream.tokens
    assert root.attributes["gen_ai.usage.input_tokens"] == up.upstream.prompt_tokens
    for name in ("admission", "queue wait", "dispatch", "first byte", "completion"):
        [span] = trace[name]
        assert span.parent_id == root.span_id, name
        assert root.start <= span.start <= span.end <= root.end, name
    [completion] = trace["completion"]
    assert completion.attributes["http.response.status_code"] == 200
    assert completion.attributes["gen_ai.usage.output_tokens"] == up.upstream.tokens
    [queue], [dispatch] = trace["queue wait"], trace["dispatch"]
    assert queue.attributes["relay.service_class"] == "default"
    assert queue.end - queue.start > 0
    assert dispatch.attributes["relay.worker.name"] == "e2e-box"
    assert (
        dispatch.attributes["relay.dispatch.reason"] == "slot freed for the oldest waiting request"
    )
    assert dispatch.attributes["relay.request_id"] == root.attributes["relay.request_id"]
    # The worker continued the trace around its backend call, and the backend got its context.
    [call] = trace["backend call"]
    assert call.service == "modelrelay-worker" and call.parent_id == dispatch.span_id
    assert call.attributes["relay.request_id"] == root.attributes["relay.request_id"]
    assert call.attributes["http.response.status_code"] == 200
    assert call.trace_state == TRACESTATE
    [forwarded] = [r for r in up.requests_to(CHAT) if CLIENT_TRACE in r.headers["traceparent"]]
    assert forwarded.headers["traceparent"] == f"00-{CLIENT_TRACE}-{call.span_id}-01"
    assert forwarded.headers["tracestate"] == TRACESTATE
    # The request without a context started a trace of its own, with its own reason.
    [other] = [r for r in roots if r.trace_id != CLIENT_TRACE]
    assert other.parent_id == ""
    [least] = of_trace(spans, other.trace_id)["dispatch"]
    assert least.attributes["relay.dispatch.reason"] == "least load"


def test_untrusted_incoming_context_starts_each_trace_at_the_edge(tmp_path: Path) -> None:
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    contexts = [
        {"traceparent": unsampled, "tracestate": TRACESTATE},
        {"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
    ]
    env = {"OTEL_TRUST_INCOMING": "false"}
    with (
        otlp_receiver() as receiver,
        upstream_in_thread() as up,
        live_server(tmp_path / "server", **otel_env(receiver, **env)) as server,
        running_worker(
            server, up.url, "--no-backend-metrics", env={**os.environ, **otel_env(receiver)}
        ),
    ):
        poll(lambda: routable(server), what="the worker's model")
        for headers in contexts:
            assert chat(server.url, headers).status_code == 200

        def complete(spans: list[Span]) -> bool:
            calls = [s for s in spans if s.name == "backend call"]
            roots = [s for s in spans if s.name == f"POST {CHAT}"]
            return len(calls) == 2 and len(roots) == 2

        spans = receiver.wait_for(complete, what="both requests' spans")
        forwarded = [r.headers for r in up.requests_to(CHAT)]
    # The relay decided (its sampler, no parent: both recorded), in traces of its own.
    roots = [s for s in spans if s.name == f"POST {CHAT}"]
    assert all(root.parent_id == "" for root in roots)
    assert len({root.trace_id for root in roots}) == 2
    assert all(s.trace_id != CLIENT_TRACE and s.trace_state == "" for s in spans)
    for root in roots:
        names = {s.name for s in spans if s.trace_id == root.trace_id}
        assert names >= {"admission", "dispatch", "first byte", "completion", "backend call"}
    # The backend got the relay's context only (the worker's, in the relay's trace).
    assert {h["traceparent"].split("-")[1] for h in forwarded} == {r.trace_id for r in roots}
    assert not any("tracestate" in h for h in forwarded)


@pytest.mark.redis
@pytest.mark.parametrize("trust", ["true", "false"])
async def test_a_request_placed_on_another_processs_worker_stays_in_one_trace(
    relay_server_factory: Any, trust: str
) -> None:
    # Between the processes the context is the relay's own: continued whatever
    # OTEL_TRUST_INCOMING says of the client's.
    with otlp_receiver() as receiver:
        env = otel_env(receiver, OTEL_TRUST_INCOMING=trust)
        with (
            upstream_in_thread() as up,
            cluster(relay_server_factory, 2, **env) as (a, b),
            running_worker(b, up.url, "--no-backend-metrics", env={**os.environ, **env}),
        ):
            await knows(a, "mock-model")
            async with httpx.AsyncClient(base_url=a.url, timeout=15) as client:
                answer = await client.post(
                    CHAT,
                    json={"model": "mock-model", "messages": []},
                    headers={"traceparent": TRACEPARENT},
                )
            assert answer.status_code == 200

            def complete(spans: list[Span]) -> bool:
                calls = [s for s in spans if s.name == "backend call"]
                if not calls:
                    return False
                return len(of_trace(spans, calls[0].trace_id).get("dispatch", [])) == 2

            spans = receiver.wait_for(complete, what="the spans of both processes")
    [origin] = [s for s in spans if s.name == f"POST {CHAT}"]
    trace = of_trace(spans, origin.trace_id)
    [placed] = trace[f"placed {CHAT}"]
    if trust == "true":
        assert origin.trace_id == CLIENT_TRACE and origin.parent_id == CLIENT_SPAN
    else:
        assert origin.trace_id != CLIENT_TRACE and origin.parent_id == ""
    by_parent = {d.parent_id: d for d in trace["dispatch"]}
    there = by_parent[origin.span_id]
    assert (
        there.attributes["relay.dispatch.reason"] == "cluster placement on another process's worker"
    )
    # The worker's process continued under the first process's dispatch...
    assert placed.parent_id == there.span_id
    here = by_parent[placed.span_id]
    assert here.attributes["relay.dispatch.reason"] == (
        "placed here by the process the client reached"
    )
    # ...and the worker under that process's own dispatch.
    [call] = trace["backend call"]
    assert call.parent_id == here.span_id
