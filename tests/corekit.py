"""Builders for pure relay-core tests: a recording link and a relay with tiny timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relay.core.config import ProviderPolicy, RelayConfig
from relay.core.relay import Relay
from relay.core.state import RelayRequest, Worker
from relay.wire import protocol

FAST = RelayConfig(
    max_queue_len=10,
    queue_timeout=5.0,
    request_timeout=10.0,
    heartbeat_interval=0.05,
    heartbeat_timeout=0.2,
    register_timeout=1.0,
    max_requeue_count=3,
    model_memory=60.0,
    drain_timeout=5.0,
    shutdown_grace=1.0,
)


@dataclass
class RecordingLink:
    """A WorkerLink that remembers every frame (decoded) and the close."""

    frames: list[protocol.ServerMessage] = field(default_factory=list)
    closed: tuple[int, str] | None = None

    def send(self, message: protocol.ServerMessage) -> None:
        assert self.closed is None, "frame sent after close"
        # Through the real encoding, as the WebSocket link would write it.
        self.frames.append(protocol.decode_server_message(protocol.encode(message)))

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    def of_type(self, kind: type) -> list:
        return [f for f in self.frames if isinstance(f, kind)]

    @property
    def requests(self) -> list[protocol.Request]:
        return self.of_type(protocol.Request)

    @property
    def cancels(self) -> list[protocol.Cancel]:
        return self.of_type(protocol.Cancel)


def make_relay(config: RelayConfig = FAST, **policy: object) -> Relay:
    relay = Relay(config, instance="t")
    relay.set_provider(ProviderPolicy.from_overrides(config, "local", **policy))  # type: ignore[arg-type]
    return relay


def attach(
    relay: Relay,
    models: list[str] | None = None,
    *,
    max_concurrent: int = 1,
    provider: str = "local",
    name: str = "w",
    load: int = 0,
    refuses: Callable[[RelayRequest], str | None] | None = None,
    features: list[str] | None = None,
    states: dict[str, str] | None = None,
    model_capacity: int | None = None,
) -> tuple[Worker, RecordingLink]:
    """A worker attached to ``relay``; with ``states`` (model -> state) it speaks the
    ``model_states`` extension (models on demand) and is acked for those models."""
    link = RecordingLink()
    model_states = None
    if states is not None:
        features = [*(features or ()), protocol.MODEL_STATES]
        model_states = [protocol.ModelState(model=m, state=s) for m, s in states.items()]
        models = list(states) if models is None else models
    worker, _ = relay.attach_worker(
        provider=provider,
        name=name,
        models=["m"] if models is None else models,
        max_concurrent=max_concurrent,
        current_load=load,
        link=link,
        refuses=refuses,
        features=features or (),
        model_states=model_states,
        model_capacity=model_capacity,
    )
    return worker, link


def submit(
    relay: Relay, model: str = "m", *, stream: bool = False, body: str = '{"model":"m"}'
) -> RelayRequest:
    return relay.submit(
        model=model,
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=stream,
        body=body,
        headers={"content-type": "application/json"},
    )


def complete(
    relay: Relay, worker: Worker, request_id: str, status: int = 200, body: str = "{}"
) -> None:
    relay.on_complete(
        worker,
        protocol.ResponseComplete(request_id=request_id, status_code=status, headers={}, body=body),
    )
