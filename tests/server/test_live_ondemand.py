"""Models on demand end to end (SPEC §19): a live relay, the real worker.py and two real
llama-servers in router mode without autoload (``make llama-server``; skipped and said
so without it). The relay decides what each box loads; loads are counted in the
routers' own logs, whoever asked for them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.live import LiveServer
from tests.test_e2e import poll, routable, running_worker
from tests.worker.test_llama_router import BINARY, MODEL, router_process

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(
        not (BINARY.is_file() and MODEL.is_file()),
        reason=f"no llama-server at {BINARY} (or no {MODEL.name}): `make llama-server` builds both",
    ),
]

SPAWN = "spawning server instance with name="


def loads(tmp_path: Path) -> int:
    return sum(
        log.read_text(errors="replace").count(SPAWN) for log in tmp_path.glob("*/router.log")
    )


async def chat(client: httpx.AsyncClient, model: str) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return await client.post("/v1/chat/completions", json=body)


def test_two_boxes_load_each_model_once_and_never_get_a_request_they_cannot_serve(
    tmp_path: Path, relay_server: LiveServer
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        router_process(tmp_path / "a", "--no-models-autoload") as box_a,
        router_process(tmp_path / "b", "--no-models-autoload") as box_b,
        running_worker(relay_server, box_a, "--worker-name", "a", "--model-poll-secs", "0.1"),
        running_worker(relay_server, box_b, "--worker-name", "b", "--model-poll-secs", "0.1"),
    ):
        poll(lambda: routable(relay_server, "alpha"), what="the workers to register")

        async def drive() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=relay_server.url, timeout=120) as client:
                # Ten at once for a model loaded nowhere: one load between them.
                burst = await asyncio.gather(*(chat(client, "alpha") for _ in range(10)))
                assert loads(tmp_path) == 1
                # Then the two models by turns: the other box loads the other one, once.
                turns = [await chat(client, model) for model in ["beta", "alpha"] * 5]
                return [*burst, *turns]

        answers = asyncio.run(drive())
        # Without autoload a request sent to the box without its model would get the
        # router's 400 "model is not loaded": none did.
        assert [r.status_code for r in answers] == [200] * 20, [
            r.text for r in answers if r.status_code != 200
        ]
        assert loads(tmp_path) == 2
        listed = httpx.get(relay_server.url + "/v1/models", timeout=10).json()["data"]
        assert {m["id"]: m.get("state") for m in listed if m["id"] in ("alpha", "beta")} == {
            "alpha": "loaded",
            "beta": "loaded",
        }
