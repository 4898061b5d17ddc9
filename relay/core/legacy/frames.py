"""The old node wire, both directions, as pure functions.

A node dials ``ws://HOST/ws?name=&model=&token=&max_concurrency=`` (one model per
connection). The server sends text frames: a task
``{"state":0,"id":N,"system":…,"messages":[{"role":…,"content":…}],"max_new_tokens":N,
"temperature":F,"created_at":SECS}`` or a stop ``{"id":N,"stop":true}``. The node
sends binary frames: a 4-byte big-endian task id and a UTF-8 text delta; the four
bytes alone mean the task finished. Its heartbeat is an empty text frame.

Task ids are kept to 31 bits, so a node that reads the id as a signed Int32BE (as
the old documentation says) and one that reads it unsigned agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs

import msgspec

#: Close codes of the old protocol.
CLOSE_NORMAL = 4000
CLOSE_MISSING_PARAMETER = 4001
CLOSE_BAD_TOKEN = 4002
CLOSE_REPLACED = 4003

#: Largest task id (31 bits).
MAX_TASK_ID = 2**31 - 1
#: A legacy node's ``protocol_version`` as operators see it (``/admin/workers``, audit rows).
LEGACY_PROTOCOL = "legacy"
#: What a task's ``state`` is when the server sends it (pending).
PENDING = 0

_PARAMETERS = ("name", "model", "token", "max_concurrency")


class BadParameters(ValueError):
    """The connect URL lacks a parameter or has an unusable one (close 4001)."""


class ShortFrame(ValueError):
    """A binary frame too short to carry a task id."""


@dataclass(frozen=True, slots=True)
class NodeParams:
    name: str
    model: str
    token: str
    max_concurrency: int
    #: The provider the token belongs to; ``None``: the server's default provider.
    provider: str | None = None


def parse_connect_query(query: str) -> NodeParams:
    """The parameters of a node's connect URL, or :class:`BadParameters` naming the problem."""
    values = parse_qs(query, keep_blank_values=True)

    def first(name: str) -> str:
        return (values.get(name) or [""])[0].strip()

    missing = [name for name in _PARAMETERS if not first(name)]
    if missing:
        raise BadParameters("missing parameter: " + ", ".join(missing))
    raw = first("max_concurrency")
    if not raw.isdigit() or not 1 <= int(raw) <= 1_000_000:
        raise BadParameters("max_concurrency must be a positive integer")
    return NodeParams(
        name=first("name"),
        model=first("model"),
        token=first("token"),
        max_concurrency=int(raw),
        provider=first("provider") or None,
    )


class Message(msgspec.Struct):
    role: str
    content: str


class Task(msgspec.Struct):
    """One task as a node receives it (field order as the old broker wrote it)."""

    id: int
    system: str
    messages: list[Message]
    max_new_tokens: int
    temperature: float
    created_at: int
    state: int = PENDING


class Stop(msgspec.Struct):
    id: int
    stop: bool = True


_encoder = msgspec.json.Encoder()
_TASK_FIELDS = ("state", "id", "system", "messages", "max_new_tokens", "temperature", "created_at")


def encode_task(task: Task) -> str:
    """The text frame that hands ``task`` to a node."""
    document = {name: getattr(task, name) for name in _TASK_FIELDS}
    return _encoder.encode(document).decode()


def encode_stop(task_id: int) -> str:
    """The text frame that tells a node to stop generating for ``task_id``."""
    return _encoder.encode(Stop(id=task_id)).decode()


def split_result(frame: bytes) -> tuple[int, bytes]:
    """``(task id, UTF-8 payload)`` of a node's binary frame; an empty payload: finished."""
    if len(frame) < 4:
        raise ShortFrame(f"binary frame of {len(frame)} byte(s), shorter than a task id")
    return int.from_bytes(frame[:4], "big"), frame[4:]


def result_frame(task_id: int, payload: bytes = b"") -> bytes:
    """A node's binary frame (used by the fake node in tests)."""
    return task_id.to_bytes(4, "big") + payload
