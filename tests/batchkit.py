"""Driving the Files, Batches and Message Batches APIs through the real ASGI app, and a
fake worker that answers what the batch engine sends it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall
from tests.stall import STALL_BUDGET_MS, LoopStalls

CHAT = "/v1/chat/completions"
Headers = list[tuple[bytes, bytes]]


def bearer(secret: str) -> Headers:
    return [(b"authorization", f"Bearer {secret}".encode())]


def multipart(
    content: bytes, purpose: str = "batch", filename: str = "in.jsonl"
) -> tuple[bytes, bytes]:
    """A multipart body as the SDKs send it (encoded by httpx), and its content type."""
    request = httpx.Request(
        "POST",
        "http://relay.test/v1/files",
        files={"file": (filename, content, "application/jsonl")},
        data={"purpose": purpose},
    )
    return request.read(), request.headers["content-type"].encode()


def line(custom_id: str, model: str = "m", url: str = CHAT, **body: Any) -> dict[str, Any]:
    document = {"model": model, "messages": [{"role": "user", "content": custom_id}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": document}


def jsonl(*documents: Any) -> bytes:
    return b"".join(
        (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n" for d in documents
    )


async def call(
    method: str, path: str, body: Any = b"", headers: Headers | None = None, **kw: Any
) -> tuple[int, Any]:
    """One request; returns the status and the body (JSON when it is)."""
    status, _, raw = await (await HttpCall(method, path, body, headers, **kw).send()).response()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


async def upload(content: bytes, headers: Headers | None = None, purpose: str = "batch") -> dict:
    body, content_type = multipart(content, purpose)
    status, document = await call("POST", "/v1/files", body, headers, content_type=content_type)
    assert status == 200, document
    return document


async def create_batch(
    file_id: str, headers: Headers | None = None, endpoint: str = CHAT, **extra: Any
) -> dict:
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    status, document = await call("POST", "/v1/batches", body, headers)
    assert status == 200, document
    return document


async def submit(
    lines: Sequence[dict | bytes], headers: Headers | None = None, **extra: Any
) -> dict:
    """Upload ``lines`` (documents, or lines as they are) and create a batch of them."""
    uploaded = await upload(jsonl(*lines), headers)
    return await create_batch(uploaded["id"], headers, **extra)


async def wait_batch(
    batch_id: str,
    done: Callable[[dict], bool],
    headers: Headers | None = None,
    path: str = "/v1/batches",
    timeout: float = 10.0,
) -> dict:
    """Re-read the batch until ``done(batch)``; fails after ``timeout``."""
    async with asyncio.timeout(timeout):
        while True:
            status, document = await call("GET", f"{path}/{batch_id}", headers=headers)
            assert status == 200, document
            if done(document):
                return document
            await asyncio.sleep(0.02)


def ended(document: dict) -> bool:
    return document["status"] in ("completed", "failed", "expired", "cancelled")


async def content(file_id: str, headers: Headers | None = None) -> list[dict]:
    status, raw = await call("GET", f"/v1/files/{file_id}/content", headers=headers)
    assert status == 200, raw
    text = raw.decode() if isinstance(raw, bytes) else json.dumps(raw) + "\n"
    return [json.loads(x) for x in text.splitlines()]


async def least_stall(prepare: Callable[[], Callable[[], Awaitable[Any]]], tries: int = 3) -> float:
    """The longest event-loop stall (tests/stall.py) a run of ``prepare()`` causes, the
    least of up to ``tries`` runs (each prepared outside the measure). A stall the code
    causes is there in every run; on a shared two-core machine another process can
    hold one run up."""
    least = float("inf")
    for _ in range(tries):
        run = prepare()
        async with LoopStalls() as stalls:
            await run()
        least = min(least, stalls.longest_ms)
        if least < STALL_BUDGET_MS:
            break
    return least


Reply = Callable[[protocol.Request], "tuple[int, str] | None"]


def echo(request: protocol.Request) -> tuple[int, str]:
    """A chat completion naming the line it answers (its message's content)."""
    said = json.loads(request.body)["messages"][0]["content"]
    return 200, json.dumps({"object": "chat.completion", "said": said})


@dataclass
class Answering:
    """A fake worker answering every request it gets with ``reply`` (None: hold it)."""

    worker: FakeWorker
    reply: Reply = echo
    requests: list[protocol.Request] = field(default_factory=list)
    cancels: list[protocol.Cancel] = field(default_factory=list)
    held: dict[str, protocol.Request] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    task: asyncio.Task[None] | None = None

    def start(self) -> Answering:
        self.task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        while True:
            message = await self.worker.recv(timeout=60)
            if isinstance(message, protocol.Request):
                self.requests.append(message)
                answer = self.reply(message)
                if answer is None:
                    self.held[message.request_id] = message
                    self.in_flight += 1
                    self.most_in_flight = max(self.most_in_flight, self.in_flight)
                    continue
                status, body = answer
                await self.worker.answer(
                    message.request_id,
                    body,
                    status,
                    prompt_tokens=3,
                    completion_tokens=2,
                    cached_tokens=1,
                )
            elif isinstance(message, protocol.Cancel):
                self.cancels.append(message)
                if self.held.pop(message.request_id, None) is not None:
                    self.in_flight -= 1

    async def release(self, request_id: str, status: int = 200) -> None:
        request = self.held.pop(request_id)
        self.in_flight -= 1
        await self.worker.answer(request_id, echo(request)[1], status)

    def said(self) -> list[str]:
        return [json.loads(r.body)["messages"][0]["content"] for r in self.requests]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, AssertionError):
                pass
