"""Sampling never changes what a client gets (SPEC §17): a request whose spans are not
recorded — an unsampled parent, a ratio sampler's no, sampling off — is answered and
charged exactly as with tracing off, runs once on the backend, and the ones sampled
still produce their spans. A live server and the real worker.py export to a real
OTLP/HTTP receiver; the client is the openai SDK with its default retries, so a 500
would also show as extra backend generations."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.fleet.otlp import Receiver, Span, otel_env, otlp_receiver
from tests.live import LiveServer, live_server
from tests.test_e2e import poll, routable, running_worker
from tests.upstream import ThreadedUpstream, expected_text, upstream_in_thread

pytestmark = pytest.mark.live

CHAT = "/v1/chat/completions"
ROOT = f"POST {CHAT}"
#: Trace ids a trace-id ratio sampler at 0.5 decides on by their low 64 bits (below
#: half of 2**64: sampled), whatever their parent's flags say.
RATIO_YES = ["5a5a5a5a5a5a5a5a0000000000000001", "6b6b6b6b6b6b6b6b0000000000000002"]
RATIO_NO = ["5a5a5a5a5a5a5a5affffffffffffff01", "6b6b6b6b6b6b6b6bffffffffffffff02"]


def traceparent(trace_id: str, sampled: bool) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-b7ad6b7169203331-{'01' if sampled else '00'}"}


@contextmanager
def traced_fleet(
    tmp_path: Path, **sampler: str
) -> Iterator[tuple[Receiver, ThreadedUpstream, LiveServer]]:
    """A server and a worker that trace with ``sampler`` (``OTEL_TRACES_SAMPLER*``)."""
    with otlp_receiver() as receiver, upstream_in_thread() as up:
        env = otel_env(receiver, **sampler)
        with (
            live_server(tmp_path / "server", **env) as server,
            running_worker(server, up.url, "--no-backend-metrics", env={**os.environ, **env}),
        ):
            poll(lambda: routable(server), what="the worker's model")
            yield receiver, up, server


def call_each(server: LiveServer, up: ThreadedUpstream, contexts: list[dict[str, str]]) -> None:
    """One call per context (every third streamed): each answered with its whole text,
    and each a single generation on the backend."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", timeout=15)
    text = expected_text(up.upstream.tokens)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"}
    ]
    for n, headers in enumerate(contexts):
        if n % 3 == 2:
            stream = client.chat.completions.create(
                model="mock-model", messages=messages, stream=True, extra_headers=headers
            )
            got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            answer = client.chat.completions.create(
                model="mock-model", messages=messages, extra_headers=headers
            )
            got = answer.choices[0].message.content or ""
        assert got == text, n
    assert len(up.requests_to(CHAT)) == len(contexts)


def backend_contexts(up: ThreadedUpstream) -> list[tuple[str, bool]]:
    """(trace id, sampled) of the context each backend call carried, in order."""
    out = []
    for recorded in up.requests_to(CHAT):
        _, trace_id, _, flags = recorded.headers["traceparent"].split("-")
        out.append((trace_id, bool(int(flags, 16) & 1)))  # (bit 1: a random trace id)
    return out


def recorded_requests(receiver: Receiver, sampled: set[str]) -> list[Span]:
    """Wait for the spans of every sampled trace (a root and a backend call each);
    nothing of any other trace may be among them."""

    def complete(spans: list[Span]) -> bool:
        roots = {s.trace_id for s in spans if s.name == ROOT}
        calls = {s.trace_id for s in spans if s.name == "backend call"}
        return roots >= sampled and calls >= sampled

    spans = receiver.wait_for(complete, what="the spans of the sampled requests")
    assert {s.trace_id for s in spans} == sampled
    for trace_id in sampled:
        names = sorted(s.name for s in spans if s.trace_id == trace_id)
        for name in (ROOT, "admission", "dispatch", "first byte", "completion", "backend call"):
            assert names.count(name) == 1, (trace_id, names)
        [root] = [s for s in spans if s.trace_id == trace_id and s.name == ROOT]
        if not root.attributes["relay.stream"]:  # (the SDK may close a stream at [DONE])
            assert root.attributes["http.response.status_code"] == 200
            assert root.attributes["relay.outcome"] == "ok"
    return spans


def test_a_client_context_that_is_not_sampled_is_answered_and_runs_once(tmp_path: Path) -> None:
    unsampled = [f"{n:x}" * 32 for n in (1, 2, 3)]
    contexts = [traceparent(t, False) for t in unsampled]
    contexts += [traceparent("ab" * 16, True), {}]  # a sampled parent, and no context
    with traced_fleet(tmp_path) as (receiver, up, server):
        call_each(server, up, contexts)
        seen = backend_contexts(up)
        # The decision travels on: the backend is told not to record either.
        assert seen[:3] == [(t, False) for t in unsampled]
        assert seen[3] == ("ab" * 16, True) and seen[4][1]
        recorded_requests(receiver, {"ab" * 16, seen[4][0]})


def test_a_trace_id_ratio_sampler_records_some_and_answers_all(tmp_path: Path) -> None:
    # Under a ratio sampler that ignores the parent, the trace id alone decides.
    contexts = [traceparent(RATIO_NO[0], True), traceparent(RATIO_YES[0], False)]
    contexts += [traceparent(RATIO_NO[1], True), traceparent(RATIO_YES[1], False)]
    contexts += [{}] * 6
    with traced_fleet(
        tmp_path, OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0.5"
    ) as (receiver, up, server):
        call_each(server, up, contexts)
        seen = backend_contexts(up)
        assert seen[:4] == [
            (RATIO_NO[0], False),
            (RATIO_YES[0], True),
            (RATIO_NO[1], False),
            (RATIO_YES[1], True),
        ]
        recorded_requests(receiver, {t for t, sampled in seen if sampled})


def test_a_parent_based_low_ratio_answers_every_unsampled_request(tmp_path: Path) -> None:
    contexts: list[dict[str, str]] = [{}] * 8 + [traceparent("cd" * 16, True)]
    with traced_fleet(
        tmp_path, OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.05"
    ) as (receiver, up, server):
        call_each(server, up, contexts)
        seen = backend_contexts(up)
        assert not all(sampled for _, sampled in seen[:8])  # (0.05**8 that all are)
        assert seen[8] == ("cd" * 16, True)  # the parent's decision stands
        recorded_requests(receiver, {t for t, sampled in seen if sampled})


def test_sampling_off_records_nothing_and_answers_everything(tmp_path: Path) -> None:
    contexts = [traceparent("ef" * 16, True), {}, traceparent("12" * 16, False), {}]
    with traced_fleet(tmp_path, OTEL_TRACES_SAMPLER="always_off") as (receiver, up, server):
        call_each(server, up, contexts)
        assert not any(sampled for _, sampled in backend_contexts(up))
    # Both programs flushed their exporters on the way out: nothing was recorded.
    assert receiver.spans == []
