"""The worker <-> server wire protocol: one typed definition per message.

JSON text frames tagged by ``"type"``. The server decodes untrusted worker frames
with :func:`decode_worker_message`; ``worker.py`` decodes server frames with
:func:`decode_server_message`. Both raise :class:`~relay.wire.errors.ProtocolError` and
nothing else. Unknown fields are ignored (newer peers may add some); unknown
``type`` values, wrong field types and missing required fields are errors.

Field names follow the reference implementation so its workers interoperate.
Every number and string a peer sends is bounded here, before anything uses it.

Extensions beyond the reference are optional and negotiated: a worker lists what it
supports in ``register.features`` and the server only sends it what it announced.

- ``"flow_control"``: the server may send ``pause`` / ``resume`` for a streaming
  request whose client reads slower than the backend writes; the worker stops
  reading that backend response until ``resume`` (TCP then slows the backend).
  Such a worker also understands every cancel reason in :data:`CancelReason`.
- ``"metrics"`` (SPEC §17): the worker sends ``metrics_sample`` frames, its
  backend's Prometheus text plus its own series, every few seconds; the server keeps
  the latest per worker for ``GET /metrics/workers``. A sample over the server's
  bounds (bytes, series) is dropped and answered with ``metrics_rejected``; the
  connection is unaffected.
- ``"backend_health"``: the worker refuses a request its backend never received
  (connection refused, reset before a byte of answer) with ``error{code:
  "backend_unreachable"}``, and the server puts the request back in the queue
  (SPEC §6 requeue rules). Without it the worker answers such a request with a 502.
  Independently of any feature, ``register`` and ``models_update`` may carry
  ``backend_error``: the worker withdrew its models because its backend cannot be
  reached (servers show it to operators; older ones ignore the field).
- ``"model_states"`` (SPEC §19, models on demand): the worker's backend may hold more
  models on disk than in memory. ``register`` then carries ``model_states`` (each
  model's state: ``loaded``, ``loading``, ``loadable`` or ``sleeping``, and its slots
  when known) and ``model_capacity`` (how many models the backend holds at once, None:
  no known bound); ``models`` still lists every model it can serve, so a relay without
  the extension sees what it always saw. The worker sends ``model_states`` (the whole
  list again) whenever a state changes, whoever changed it. The relay loads and unloads
  with ``model_load`` / ``model_unload`` (each with an ``op_id``), answered by one
  ``model_result`` each. A relay with the extension routes a model only to workers where
  it is ``loaded``; a worker without it counts as having every acked model loaded.
  States a relay does not know count as not loaded.
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
    # Extensions: sent only to workers announcing a feature (see the module docstring).
    "stream_limit",
    "slow_client",
    "preempted",
]
#: The reasons every worker understands (the reference set).
BASE_CANCEL_REASONS = frozenset(
    {
        "client_disconnect",
        "timeout",
        "graceful_shutdown",
        "worker_disconnect",
        "requeue_exhausted",
        "server_shutdown",
    }
)
FLOW_CONTROL = "flow_control"
METRICS = "metrics"
BACKEND_HEALTH = "backend_health"
MODEL_STATES = "model_states"
#: Features this implementation's worker and server both speak.
FEATURES = (FLOW_CONTROL, METRICS, BACKEND_HEALTH, MODEL_STATES)

#: Model states (``model_states``): in memory and serving; being loaded; on disk only;
#: put to sleep (in host memory, woken faster than a load).
LOADED = "loaded"
LOADING = "loading"
LOADABLE = "loadable"
SLEEPING = "sleeping"
MODEL_STATE_NAMES = (LOADED, LOADING, LOADABLE, SLEEPING)
#: The most entries a ``model_states`` list may hold (the relay keeps at most its
#: MAX_MODELS_PER_WORKER of them).
MAX_MODEL_STATES = 4096

#: Bounds on numbers from a peer: far above any real value, far below what could
#: overflow a float or a metric (a worker once reported a load of 10**300).
MAX_COUNT = 1_000_000
MAX_TOKENS = 10**12
MAX_TIMESTAMP_MS = 10**15

#: The widest integers the reference's pong carries (``current_load: u32``,
#: ``timestamp_unix_ms: u64``): accepted, then clamped to the bounds above.
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
#: msgspec bounds only what fits an int64: the upper end is checked in ``__post_init__``.
U64 = Annotated[int, msgspec.Meta(ge=0)]
#: Milliseconds a backend says it spent (llama-server's ``timings``): a day at most;
#: anything else is dropped, not a protocol error (see :class:`TokenCounts`).
MAX_BACKEND_MS = 86_400_000.0
Timestamp = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIMESTAMP_MS)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
ShortText = Annotated[str, msgspec.Meta(max_length=1024)]


class TokenCounts(msgspec.Struct, omit_defaults=True):
    """A request's tokens as the worker reports them.

    Each count takes what the reference's ``u64`` holds; one past :data:`MAX_TOKENS`
    (a backend's unsigned underflow, a corrupt usage object) is no figure to charge a
    key or add to a metric: it is dropped (None) and the counts are marked
    ``estimated``, so the request still completes on a connection that stays up. What a
    ``u64`` cannot hold (negative, wider, not an integer) is a protocol error.
    """

    prompt_tokens: U64 | None = None
    completion_tokens: U64 | None = None
    total_tokens: U64 | None = None
    #: Prompt tokens the backend reused from its cache (optional; SPEC §14).
    cached_tokens: U64 | None = None
    #: True when the figures are not all the backend's own: it reported no usage and
    #: the worker counted the stream itself, or a count past :data:`MAX_TOKENS` was
    #: dropped (labelled an estimate wherever the figures are shown).
    estimated: bool = False
    #: What the backend says it spent on the prompt tokens it processed (those it did
    #: not find cached) and on generating, in milliseconds: llama-server's
    #: ``timings.prompt_ms`` and ``predicted_ms`` (optional; SPEC §21, learned speeds).
    prefill_ms: float | None = None
    decode_ms: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_ms is not None or self.decode_ms is not None:
            # Figures to learn speeds from, nothing to charge: one that is no duration
            # (negative, not finite, past a day) is left out, the frame kept.
            for name in ("prefill_ms", "decode_ms"):
                value = getattr(self, name)
                if value is not None and not 0 <= value <= MAX_BACKEND_MS:
                    setattr(self, name, None)
        if (  # (the usual case, checked first: one comparison per count)
            (self.prompt_tokens or 0) <= MAX_TOKENS
            and (self.completion_tokens or 0) <= MAX_TOKENS
            and (self.total_tokens or 0) <= MAX_TOKENS
            and (self.cached_tokens or 0) <= MAX_TOKENS
        ):
            return
        for name in _COUNT_FIELDS:
            count = getattr(self, name)
            if count is None or count <= MAX_TOKENS:
                continue
            if count > U64_MAX:
                raise ValueError(f"`{name}` does not fit in 64 bits")
            setattr(self, name, None)
            self.estimated = True


_COUNT_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


class ModelState(msgspec.Struct, omit_defaults=True):
    """One model's state on a worker (``model_states``)."""

    model: str
    #: One of :data:`MODEL_STATE_NAMES`; any short text is accepted (a newer worker's
    #: state must not cost the connection) and an unknown one counts as not loaded.
    state: ShortText
    #: Requests this model runs at once on the backend, when the backend tells.
    slots: Annotated[int, msgspec.Meta(ge=1, le=U32_MAX)] | None = None

    def __post_init__(self) -> None:
        if self.slots is not None:
            self.slots = min(self.slots, MAX_COUNT)


ModelStateList = Annotated[list[ModelState], msgspec.Meta(max_length=MAX_MODEL_STATES)]
ModelCapacity = Annotated[int, msgspec.Meta(ge=1, le=U32_MAX)]
OpId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


# --- server -> worker --------------------------------------------------------


class RegisterAck(msgspec.Struct, tag="register_ack", tag_field="type"):
    worker_id: str
    models: list[str]
    protocol_version: str = PROTOCOL_VERSION
    warnings: list[str] = []
    #: Extensions (optional; absent for peers that do not send them): the server's
    #: ping period, so a worker can tell a dead connection from a quiet one, and the
    #: features of the worker's ``register`` that the server will use.
    heartbeat_interval_secs: Annotated[float, msgspec.Meta(gt=0, le=86_400)] | None = None
    features: Annotated[list[ShortText], msgspec.Meta(max_length=64)] = []


class Request(msgspec.Struct, tag="request", tag_field="type"):
    request_id: str
    model: str
    endpoint_path: str
    is_streaming: bool
    body: str
    headers: dict[str, str] = {}


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    request_id: str
    #: One of :data:`CancelReason`; any short string is accepted so that a newer
    #: server's reason never makes a worker drop the cancel itself.
    reason: ShortText


class Pause(msgspec.Struct, tag="pause", tag_field="type"):
    """Stop reading the backend's response for this request (``flow_control``)."""

    request_id: str


class Resume(msgspec.Struct, tag="resume", tag_field="type"):
    """Read the backend's response for this request again (``flow_control``)."""

    request_id: str


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    timestamp_unix_ms: Timestamp | None = None


class GracefulShutdown(msgspec.Struct, tag="graceful_shutdown", tag_field="type"):
    reason: str | None = None
    drain_timeout_secs: Annotated[int, msgspec.Meta(ge=0, le=10**7)] | None = None


class ModelsRefresh(msgspec.Struct, tag="models_refresh", tag_field="type"):
    reason: str | None = None


class MetricsRejected(msgspec.Struct, tag="metrics_rejected", tag_field="type"):
    """A ``metrics_sample`` was dropped (``metrics``): why, and the server's bounds."""

    reason: ShortText
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_series: Annotated[int, msgspec.Meta(ge=0)] = 0


class ModelLoad(msgspec.Struct, tag="model_load", tag_field="type"):
    """Load ``model`` into the backend's memory (``model_states``); answered by one
    ``model_result`` with the same ``op_id``."""

    model: str
    op_id: OpId


class ModelUnload(msgspec.Struct, tag="model_unload", tag_field="type"):
    """Free ``model``'s memory (``model_states``): unloaded, or put to sleep where the
    backend sleeps; answered by one ``model_result`` with the same ``op_id``."""

    model: str
    op_id: OpId


ServerMessage = (
    RegisterAck
    | Request
    | Cancel
    | Ping
    | GracefulShutdown
    | ModelsRefresh
    | Pause
    | Resume
    | MetricsRejected
    | ModelLoad
    | ModelUnload
)

# --- worker -> server --------------------------------------------------------


class Register(msgspec.Struct, tag="register", tag_field="type"):
    """``max_concurrent`` and ``current_load`` take what the reference's u32 holds,
    clamped to :data:`MAX_COUNT` (the server may sanitize what a worker declares)."""

    worker_name: ShortText
    models: list[str] = []
    max_concurrent: Annotated[int, msgspec.Meta(ge=1, le=U32_MAX)] = 1
    protocol_version: ShortText | None = None
    current_load: U32 = 0
    #: Optional extensions this worker supports (see the module docstring).
    features: Annotated[list[ShortText], msgspec.Meta(max_length=64)] = []
    #: Why the worker advertises no models: its backend cannot be reached.
    backend_error: ShortText | None = None
    #: ``model_states``: each model's state, and how many models the backend holds at
    #: once (None: no known bound).
    model_states: ModelStateList | None = None
    model_capacity: ModelCapacity | None = None

    def __post_init__(self) -> None:
        self.max_concurrent = min(self.max_concurrent, MAX_COUNT)
        self.current_load = min(self.current_load, MAX_COUNT)
        if self.model_capacity is not None:
            self.model_capacity = min(self.model_capacity, MAX_COUNT)


class ModelsUpdate(msgspec.Struct, tag="models_update", tag_field="type"):
    models: list[str]
    current_load: U32 | None = None
    #: Set while the backend cannot be reached (``models`` is then empty): why.
    backend_error: ShortText | None = None

    def __post_init__(self) -> None:
        if self.current_load is not None:
            self.current_load = min(self.current_load, MAX_COUNT)


class ModelStates(msgspec.Struct, tag="model_states", tag_field="type"):
    """Every model's state now (``model_states``), sent whenever one changed."""

    states: ModelStateList
    model_capacity: ModelCapacity | None = None
    #: The requests the worker runs at once now, when that changed with the models
    #: (llama-server's router: the slots of the loaded models); None: as registered.
    max_concurrent: Annotated[int, msgspec.Meta(ge=1, le=U32_MAX)] | None = None

    def __post_init__(self) -> None:
        if self.model_capacity is not None:
            self.model_capacity = min(self.model_capacity, MAX_COUNT)
        if self.max_concurrent is not None:
            self.max_concurrent = min(self.max_concurrent, MAX_COUNT)


class ModelResult(msgspec.Struct, tag="model_result", tag_field="type"):
    """The answer to one ``model_load`` / ``model_unload``."""

    op_id: OpId
    model: str
    op: Literal["load", "unload"]
    ok: bool
    #: The model's state once the operation ended.
    state: ShortText = ""
    #: Why it failed (``ok`` false).
    error: ShortText | None = None
    duration_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None


class ResponseChunk(msgspec.Struct, tag="response_chunk", tag_field="type"):
    request_id: RequestId
    chunk: str


class ResponseComplete(msgspec.Struct, tag="response_complete", tag_field="type"):
    request_id: RequestId
    status_code: Annotated[int, msgspec.Meta(ge=0, le=999)]
    headers: dict[str, str] = {}
    body: str | None = None
    token_counts: TokenCounts | None = None


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    """Any value the reference's types hold is accepted (a timestamp in microseconds,
    a load of 2**31) and clamped to :data:`MAX_COUNT` / :data:`MAX_TIMESTAMP_MS`;
    what they cannot hold (negative, wider, not an integer) is a protocol error."""

    current_load: U32 = 0
    timestamp_unix_ms: U64 | None = None

    def __post_init__(self) -> None:
        if self.timestamp_unix_ms is not None and self.timestamp_unix_ms > U64_MAX:
            raise ValueError("`timestamp_unix_ms` does not fit in 64 bits")
        if self.current_load > MAX_COUNT:
            self.current_load = MAX_COUNT
        if self.timestamp_unix_ms is not None and self.timestamp_unix_ms > MAX_TIMESTAMP_MS:
            self.timestamp_unix_ms = MAX_TIMESTAMP_MS


class Error(msgspec.Struct, tag="error", tag_field="type"):
    message: str = ""
    request_id: RequestId | None = None
    code: ShortText | None = None


class MetricsSample(msgspec.Struct, tag="metrics_sample", tag_field="type"):
    """The worker's latest metrics (``metrics``): Prometheus text exposition (format
    0.0.4) of its backend's endpoint followed by the worker's own series."""

    text: str
    #: Whether the backend's endpoint answered this time (its series are absent if not).
    backend_up: bool = True
    #: How often the worker sends one (the server reports a sample's age against it).
    interval_secs: Annotated[float, msgspec.Meta(gt=0, le=86_400)] | None = None


#: ``error.code`` with which a worker that is shutting down refuses a request it was
#: sent before the server knew: the server puts the request back in the queue.
WORKER_DRAINING = "worker_draining"
#: ``error.code`` (``backend_health``) for a request the worker's backend never
#: received: the server requeues it under the rules of SPEC §6.
BACKEND_UNREACHABLE = "backend_unreachable"


WorkerMessage = (
    Register
    | ModelsUpdate
    | ResponseChunk
    | ResponseComplete
    | Pong
    | Error
    | MetricsSample
    | ModelStates
    | ModelResult
)

_encoder = msgspec.json.Encoder()
_worker_decoder = msgspec.json.Decoder(WorkerMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


def encode(message: ServerMessage | WorkerMessage) -> str:
    """Serialize a message to the text of one WebSocket frame."""
    return _encoder.encode(message).decode()


def frame_fits(message: Request, limit: int) -> bool:
    """True when ``message`` encodes to at most ``limit`` bytes.

    Cheap for the usual request: JSON escaping makes a character at most six bytes,
    so only bodies near ``limit / 6`` are encoded to be measured exactly.
    """
    chars = len(message.body) + len(message.model) + len(message.endpoint_path)
    chars += len(message.request_id) + sum(len(k) + len(v) for k, v in message.headers.items())
    if 6 * chars + 256 <= limit:
        return True
    return len(_encoder.encode(message)) <= limit


def _decode(decoder: msgspec.json.Decoder, raw: str | bytes) -> object:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError:
        raise ProtocolError("frame is not valid UTF-8") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None


def decode_worker_message(raw: str | bytes) -> WorkerMessage:
    """Validate one untrusted frame from a worker.

    Raises :class:`ProtocolError` with a short, loggable reason on anything that is
    not exactly one well-formed worker message.
    """
    return _decode(_worker_decoder, raw)  # type: ignore[return-value]


def decode_server_message(raw: str | bytes) -> ServerMessage:
    """Validate one frame from the server (used by ``worker.py``)."""
    return _decode(_server_decoder, raw)  # type: ignore[return-value]
