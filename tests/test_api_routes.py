"""The rest of the client API (SPEC §5): completions, embeddings, token counting, rerank
and score through a live server and the real ``worker.py``, with the official SDKs
where they have a call for it; model aliases; JSON errors on every other /v1 path."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.live import LiveServer
from tests.test_e2e import JSON, MODEL, Stack, poll, routable, running_worker, token_metrics
from tests.upstream import ThreadedUpstream, expected_text, upstream_in_thread

pytestmark = pytest.mark.live

ALIASES = json.dumps({"gpt-4o-mini": MODEL})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tests.live import live_server

    with (
        upstream_in_thread(total_slots=4) as upstream,
        live_server(
            tmp_path_factory.mktemp("routes"),
            MODEL_ALIASES=ALIASES,
            RELAY_ROUTES="default,/v1/audio/speech,-/v1/score",
        ) as server,
        running_worker(server, upstream.url) as worker,
        httpx.Client(base_url=server.url, timeout=15, headers=JSON) as client,
    ):
        poll(lambda: routable(server), what="the worker to register")
        yield Stack(server, upstream, worker, client)


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def last_request(upstream: ThreadedUpstream, path: str) -> dict:
    return json.loads(upstream.upstream.requests_to(path)[-1].body)


def test_embeddings_through_the_sdk(stack: Stack) -> None:
    result = sdk(stack.server).embeddings.create(model=MODEL, input=["one", "two"])
    assert [e.embedding for e in result.data] == [[0.25, 0.5, -0.5, 1.0], [0.5, 0.5, -0.5, 1.0]]
    assert result.usage.prompt_tokens == 6
    assert last_request(stack.upstream, "/v1/embeddings")["input"] == ["one", "two"]


def test_completions_through_the_sdk_streaming_and_not(stack: Stack) -> None:
    client = sdk(stack.server)
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8)
    assert whole.choices[0].text == expected_text(stack.upstream.upstream.tokens)
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    pieces = client.completions.create(
        model=MODEL, prompt="Once upon", stream=True, extra_body={"mock": {"tokens": 5}}
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == expected_text(5)


def test_anthropic_token_counting_through_the_sdk(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.server.url, api_key="sk-ant", max_retries=0)
    counted = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert counted.input_tokens == 7
    assert stack.upstream.upstream.requests_to("/v1/messages/count_tokens")


def test_rerank_is_routed_by_model_and_counted(stack: Stack) -> None:
    before = token_metrics(stack.server).get("prompt", 0.0)
    response = stack.client.post(
        "/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a", "b", "c"]}
    )
    assert response.status_code == 200
    assert [r["index"] for r in response.json()["results"]] == [0, 1, 2]
    metrics = stack.client.get("/metrics").text
    assert 'endpoint="/v1/rerank",model="mock-model",outcome="ok"' in metrics
    assert token_metrics(stack.server).get("prompt", 0.0) == before  # rerank reports no prompt


def test_operators_restrict_and_extend_the_routes(stack: Stack) -> None:
    speech = stack.client.post("/v1/audio/speech", json={"model": MODEL, "input": "hello"})
    assert speech.status_code == 200
    assert speech.headers["content-type"] == "audio/mpeg"
    assert speech.content == b"ID3\x04mock-audio"
    removed = stack.client.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"})
    assert removed.status_code == 404
    assert removed.json()["error"]["type"] == "invalid_request_error"


def test_an_alias_reaches_the_backend_under_its_own_name(stack: Stack) -> None:
    raw = b'{"model":  "gpt-4o-mini", "messages": [{"role":"user","content":"hi"}], "n": 1}'
    response = stack.client.post("/v1/chat/completions", content=raw)
    assert response.status_code == 200
    sent = stack.upstream.upstream.requests_to("/v1/chat/completions")[-1].body
    assert json.loads(sent) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 1,
    }
    plain = b'{"model":  "mock-model", "messages": [{"role":"user","content":"hi"}]}'
    stack.client.post("/v1/chat/completions", content=plain)
    sent = stack.upstream.upstream.requests_to("/v1/chat/completions")[-1].body
    assert sent == plain  # untouched
    listed = {m.id: m.owned_by for m in sdk(stack.server).models.list()}
    assert listed == {MODEL: "local", "gpt-4o-mini": "local"}
    result = sdk(stack.server).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    assert result.choices[0].message.content == expected_text(stack.upstream.upstream.tokens)


def test_the_anthropic_sdk_pages_through_the_models(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.server.url, api_key="sk-ant", max_retries=0)
    first = client.models.list(limit=1)
    assert [m.id for m in first.data] == ["gpt-4o-mini"] and first.has_more
    assert [m.id for m in client.models.list(limit=1)] == ["gpt-4o-mini", MODEL]  # all pages
    later = client.models.list(after_id="gpt-4o-mini")
    assert [m.id for m in later.data] == [MODEL] and not later.has_more
    earlier = client.models.list(before_id=MODEL)
    assert [m.id for m in earlier.data] == ["gpt-4o-mini"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.BadRequestError):
        client.models.list(limit=0)


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "envelope"),
    [
        ("POST", "/v1/nope", {}, 404, "openai"),
        ("GET", "/v1/audio/transcriptions", {}, 404, "openai"),
        ("POST", "/v1/messages/nope", {}, 404, "anthropic"),
        ("PUT", "/v1/messages/batches", {}, 405, "anthropic"),
        ("PATCH", "/v1/files", {}, 405, "openai"),
        ("GET", "/v1/whatever", {"anthropic-version": "2023-06-01"}, 404, "anthropic"),
        ("GET", "/v1/chat/completions", {}, 405, "openai"),
        ("PUT", "/v1/embeddings", {}, 405, "openai"),
        ("DELETE", "/v1/messages/count_tokens", {}, 405, "anthropic"),
        ("POST", "/v1/models", {}, 405, "openai"),
        ("GET", "/v1/worker/connect", {}, 426, "openai"),
    ],
)
def test_every_other_v1_path_and_method_answers_json(
    stack: Stack, method: str, path: str, headers: dict[str, str], status: int, envelope: str
) -> None:
    response = stack.client.request(method, path, headers=headers, content=b"{}")
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    document = response.json()
    if envelope == "anthropic":
        assert document["type"] == "error" and document["error"]["type"]
    else:
        assert document["error"]["code"]
    if status == 405:
        assert response.headers["allow"] in ("POST", "GET, HEAD", "GET, POST")


def test_the_admin_json_api_answers_json_for_unknown_paths_and_methods(stack: Stack) -> None:
    for method, path, status in (
        ("GET", "/admin/nope", 404),
        ("PUT", "/admin/workers", 405),
        ("GET", "/admin/keys/1", 405),
    ):
        response = stack.client.request(method, path)
        assert response.status_code == status, path
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["detail"]
