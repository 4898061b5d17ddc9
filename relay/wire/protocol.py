"""The worker <-> server wire protocol: one typed definition per message.

JSON text frames tagged by ``"type"``. The server decodes untrusted worker frames
with :func:`decode_worker_message`; ``worker.py`` decodes server frames with
:func:`decode_server_message`. Both raise :class:`~relay.wire.errors.ProtocolError` and
nothing else. Unknown fields are ignored (newer peers may add some); unknown
``type`` values, wrong field types and missing required fields are errors.

Field names follow the reference implementation so its workers interoperate.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from relay.wire.errors import ProtocolError

#: Protocol versions this implementation speaks. ``"1"`` is ours; the second is the
#: reference implementation's bridge protocol, which is wire-identical.
PROTOCOL_VERSION = "1"
ACCEPTED_PROTOCOL_VERSIONS = frozenset({"1", "2026-04-bridge-v1"})

CancelReason = Literal[
    "client_disconnect",
    "timeout",
    "graceful_shutdown",
    "worker_disconnect",
    "requeue_exhausted",
    "server_shutdown",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class TokenCounts(msgspec.Struct, omit_defaults=True):
    prompt_tokens: NonNegative | None = None
    completion_tokens: NonNegative | None = None
    total_tokens: NonNegative | None = None


# --- server -> worker --------------------------------------------------------


class RegisterAck(msgspec.Struct, tag="register_ack", tag_field="type"):
    worker_id: str
    models: list[str]
    protocol_version: str = PROTOCOL_VERSION
    warnings: list[str] = []


class Request(msgspec.Struct, tag="request", tag_field="type"):
    request_id: str
    model: str
    endpoint_path: str
    is_streaming: bool
    body: str
    headers: dict[str, str] = {}


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    request_id: str
    reason: CancelReason


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    timestamp_unix_ms: int | None = None


class GracefulShutdown(msgspec.Struct, tag="graceful_shutdown", tag_field="type"):
    reason: str | None = None
    drain_timeout_secs: int | None = None


class ModelsRefresh(msgspec.Struct, tag="models_refresh", tag_field="type"):
    reason: str | None = None


ServerMessage = RegisterAck | Request | Cancel | Ping | GracefulShutdown | ModelsRefresh

# --- worker -> server --------------------------------------------------------


class Register(msgspec.Struct, tag="register", tag_field="type"):
    worker_name: str
    models: list[str] = []
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] = 1
    protocol_version: str | None = None
    current_load: NonNegative = 0


class ModelsUpdate(msgspec.Struct, tag="models_update", tag_field="type"):
    models: list[str]
    current_load: NonNegative | None = None


class ResponseChunk(msgspec.Struct, tag="response_chunk", tag_field="type"):
    request_id: RequestId
    chunk: str


class ResponseComplete(msgspec.Struct, tag="response_complete", tag_field="type"):
    request_id: RequestId
    status_code: int
    headers: dict[str, str] = {}
    body: str | None = None
    token_counts: TokenCounts | None = None


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    current_load: NonNegative = 0
    timestamp_unix_ms: int | None = None


class Error(msgspec.Struct, tag="error", tag_field="type"):
    message: str = ""
    request_id: RequestId | None = None
    code: str | None = None


WorkerMessage = Register | ModelsUpdate | ResponseChunk | ResponseComplete | Pong | Error

_encoder = msgspec.json.Encoder()
_worker_decoder = msgspec.json.Decoder(WorkerMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


def encode(message: ServerMessage | WorkerMessage) -> str:
    """Serialize a message to the text of one WebSocket frame."""
    return _encoder.encode(message).decode()


def _decode(decoder: msgspec.json.Decoder, raw: str | bytes) -> object:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError:
        raise ProtocolError("frame is not valid UTF-8") from None


def decode_worker_message(raw: str | bytes) -> WorkerMessage:
    """Validate one untrusted frame from a worker.

    Raises :class:`ProtocolError` with a short, loggable reason on anything that is
    not exactly one well-formed worker message.
    """
    return _decode(_worker_decoder, raw)  # type: ignore[return-value]


def decode_server_message(raw: str | bytes) -> ServerMessage:
    """Validate one frame from the server (used by ``worker.py``)."""
    return _decode(_server_decoder, raw)  # type: ignore[return-value]
