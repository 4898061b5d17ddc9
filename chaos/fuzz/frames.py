"""Mutated worker -> server frames, from valid frames of every worker message type.

:class:`FrameMaker` builds a valid ``register``, ``models_update``, ``response_chunk``,
``response_complete``, ``pong`` or ``error`` frame and damages it one way or more:

- in its structure: a field replaced by a hostile value (wrong type, huge or negative
  number, very long or empty string, NUL and lone surrogates, deep nesting), a field
  deleted, an unknown field or an unknown/wrong ``type``, duplicate keys, hostile
  headers and status codes in a completion, request ids that are unknown, too long,
  or belong to other workers' requests;
- in its bytes: flipped bits, deleted, inserted or duplicated ranges, truncation,
  invalid UTF-8 in a text frame, the whole frame sent as a binary frame;
- in its size: deep nesting, and frames over the server's MAX_MESSAGE_BYTES.

Each frame says whether it is still a *valid* message (the server must process it and
keep the connection: an unknown request id is dropped, a pong is a pong) or may be
a protocol violation (the server may close the connection with 1002/1007/1009).
Model names never include the model the real worker serves, so no hostile peer is
ever routed a real client's request.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HOSTILE_MODEL = "fuzz-model"

_HUGE_INT = int("9" * 400)


@dataclass
class Frame:
    payload: str | bytes
    #: "text" or "binary" (the WebSocket frame type to send it as).
    kind: str
    label: str
    #: True when the frame is a well-formed message (the server must keep the connection).
    valid: bool


def _dump(document: object) -> str:
    return json.dumps(document, separators=(",", ":"))


class FrameMaker:
    """Frames for one fuzzing run; ``other_ids()`` gives request ids of real requests."""

    def __init__(
        self, rng: random.Random, other_ids: Callable[[], list[str]], max_message: int
    ) -> None:
        self.rng = rng
        self.other_ids = other_ids
        self.max_message = max_message

    # -- valid frames ------------------------------------------------------------

    def request_id(self, own: str | None = None) -> str:
        rng = self.rng
        roll = rng.random()
        if own is not None and roll < 0.4:
            return own
        if roll < 0.7:
            ids = self.other_ids()
            if ids:
                return rng.choice(ids)
        return rng.choice(
            ["r-unknown-1", f"r-{rng.getrandbits(24):06x}-{rng.randint(1, 999):x}", "x"]
        )

    def models(self) -> list[str]:
        rng = self.rng
        return rng.choice(
            [
                [HOSTILE_MODEL],
                [f"fuzz-{rng.randint(0, 50)}"],
                [],
                [HOSTILE_MODEL, f"fuzz-{rng.randint(0, 50)}", " padded ", "", HOSTILE_MODEL],
            ]
        )

    def document(self, kind: str, own: str | None = None) -> dict[str, Any]:
        rng = self.rng
        if kind == "register":
            return {
                "type": "register",
                "worker_name": f"fuzz-{rng.randint(0, 9999)}",
                "models": self.models(),
                "max_concurrent": rng.randint(1, 4),
                "protocol_version": "1",
                "current_load": 0,
                "features": rng.choice([[], ["flow_control"], ["unknown-feature"]]),
            }
        if kind == "models_update":
            return {
                "type": "models_update",
                "models": self.models(),
                "current_load": rng.randint(0, 3),
            }
        if kind == "response_chunk":
            return {
                "type": "response_chunk",
                "request_id": self.request_id(own),
                "chunk": 'data: {"choices":[{"delta":{"content":" x"}}]}\n\n',
            }
        if kind == "response_complete":
            return {
                "type": "response_complete",
                "request_id": self.request_id(own),
                "status_code": 200,
                "headers": {"content-type": "application/json"},
                "body": '{"choices":[]}',
                "token_counts": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            }
        if kind == "pong":
            return {"type": "pong", "current_load": rng.randint(0, 3), "timestamp_unix_ms": 1}
        return {
            "type": "error",
            "message": "backend exploded",
            "request_id": self.request_id(own),
            "code": rng.choice(["x", "worker_draining", None]),
        }

    KINDS = ("register", "models_update", "response_chunk", "response_complete", "pong", "error")

    def valid(self, own: str | None = None) -> Frame:
        """A well-formed frame with hostile content: request ids that are unknown or other
        workers', odd but legal values (never ``register``: that is only valid first)."""
        rng = self.rng
        kind = rng.choice(self.KINDS[1:])
        document = self.document(kind, own)
        label = f"{kind} (well-formed)"
        if rng.random() < 0.5:
            if kind == "pong":
                document["current_load"] = rng.choice([0, 1, 1000, 1_000_000])
                document["timestamp_unix_ms"] = rng.choice([0, None, 10**15])
                document["unknown"] = [1, {"a": None}]
                label = "pong with edge values"
            elif kind == "models_update":
                document["models"] = rng.choice(
                    [
                        [f"fuzz-m{i}" for i in range(rng.randint(200, 400))],
                        ["", " ", "\t", "z" * 300, HOSTILE_MODEL, HOSTILE_MODEL],
                    ]
                )
                label = "models_update with odd models"
            elif kind == "response_chunk":
                document["chunk"] = rng.choice(
                    ["", "\u0000", "y" * rng.randint(1000, 60_000), "\r\n0\r\n\r\nHTTP/1.1 200 OK"]
                )
                label = "response_chunk with odd content"
            elif kind == "response_complete":
                document["status_code"] = rng.choice([0, 100, 101, 204, 304, 599, 999])
                document["headers"] = self.hostile_headers()
                document["body"] = rng.choice([None, "", "\u0000" * 10])
                document["token_counts"] = rng.choice(
                    [None, {}, {"prompt_tokens": 10**12}, {"total_tokens": 0}]
                )
                label = "response_complete with odd status/headers"
            else:
                document["message"] = "m" * rng.randint(0, 50_000)
                document["request_id"] = rng.choice([None, document["request_id"]])
                label = "error with odd fields"
        return Frame(_dump(document), "text", label, True)

    # -- damaged frames ------------------------------------------------------------

    def hostile_value(self) -> tuple[object, str]:
        rng = self.rng
        depth = rng.randint(50, 500)  # deeper ones: :meth:`huge`, as raw text
        nested: list[Any] = []
        for _ in range(depth):
            nested = [nested]
        return rng.choice(
            [
                (None, "null"),
                (True, "bool"),
                (-1, "negative"),
                (2**63, "2**63"),
                (_HUGE_INT, "400-digit number"),
                (1e308, "1e308"),
                (0.5, "float"),
                ("", "empty string"),
                ("x" * rng.randint(129, 20_000), "long string"),
                ("\u0000\ud800\udfff\ufffe", "NUL and surrogates"),
                ([], "empty list"),
                ({}, "empty object"),
                (["a"] * rng.randint(300, 5000), "long list"),
                (nested, f"nested {depth}"),
                ({"a": 1}, "object"),
                (12345, "int"),
            ]
        )

    def structural(self, own: str | None) -> Frame:
        rng = self.rng
        kind = rng.choice(self.KINDS)
        document = self.document(kind, own)
        roll = rng.random()
        if roll < 0.45:
            key = rng.choice(list(document))
            value, what = self.hostile_value()
            document[key] = value
            label = f"{kind}.{key} = {what}"
        elif roll < 0.55:
            key = rng.choice(list(document))
            del document[key]
            label = f"{kind} without {key}"
        elif roll < 0.62:
            document["type"] = rng.choice(
                ["Register", "ping", "request", "", "pong ", "x" * 300, 7]
            )
            label = f"{kind} with a wrong type"
        elif roll < 0.7:
            document[rng.choice(["extra", "__proto__", "", "\u0000"])] = rng.choice([1, "x", [1]])
            label = f"{kind} with an unknown field"
        elif roll < 0.8:
            complete = self.document("response_complete", own)
            complete["status_code"] = rng.choice(
                [0, 1, 99, 100, 101, 199, 204, 304, 600, 999, 1000, -5]
            )
            complete["headers"] = self.hostile_headers()
            if rng.random() < 0.5:
                complete["body"] = rng.choice(["", "x" * 5000, "\u0000", "HTTP/1.1 200 OK\r\n\r\n"])
            document, label = complete, "response_complete with hostile status/headers"
        elif roll < 0.9:
            text = _dump(document)
            key = rng.choice(list(document))
            text = text[:-1] + f',"{key}":' + _dump(self.hostile_value()[0]) + "}"
            return Frame(text, "text", f"{kind} with a duplicate {key}", False)
        else:
            document["request_id"] = rng.choice(["", "r" * 129, "r-" + "9" * 120, 42])
            label = f"{kind} with a bad request_id"
        return Frame(_dump(document), "text", label, False)

    def hostile_headers(self) -> dict[str, str]:
        rng = self.rng
        choices = [
            {"content-type": "text/html", "set-cookie": "a=b", "access-control-allow-origin": "*"},
            {"x-inject": "a\r\nset-cookie: evil=1"},
            {"bad name": "v", "": "empty name"},
            {"x-\u00e9": "\u00e9\u4e2d"},
            {"content-length": rng.choice(["-1", "999999", "abc", "0"])},
            {"transfer-encoding": "chunked", "connection": "close, x-other"},
            {"x-long": "v" * rng.randint(1000, 60_000)},
            {f"x-h{i}": "v" for i in range(rng.randint(100, 600))},
            {"x-nul": "a\u0000b", "x-del": "\u007f"},
        ]
        return dict(rng.choice(choices))

    def bytewise(self, own: str | None) -> Frame:
        rng = self.rng
        kind = rng.choice(self.KINDS)
        data = bytearray(_dump(self.document(kind, own)).encode())
        roll = rng.random()
        if roll < 0.25:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            label = "flipped bits"
        elif roll < 0.4:
            start = rng.randrange(len(data))
            del data[start : start + rng.randint(1, 20)]
            label = "deleted bytes"
        elif roll < 0.55:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 16))
            label = "inserted bytes"
        elif roll < 0.65:
            del data[rng.randrange(len(data)) :]
            label = "truncated"
        elif roll < 0.72:
            start = rng.randrange(len(data))
            piece = data[start : start + rng.randint(1, 40)]
            data[start:start] = piece
            label = "duplicated range"
        elif roll < 0.85:
            at = rng.randrange(len(data))
            data[at:at] = rng.choice([b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80"])
            return Frame(bytes(data), "text", "invalid UTF-8", False)
        else:
            return Frame(bytes(data), "binary", f"{kind} as a binary frame", False)
        return Frame(bytes(data), "text", f"{kind} {label}", False)

    def huge(self) -> Frame:
        rng = self.rng
        if rng.random() < 0.5:
            depth = rng.randint(5_000, self.max_message // 2 - 100)
            text = '{"type":"pong","x":' + "[" * depth + "]" * depth + "}"
            return Frame(text, "text", "deep nesting", False)
        size = self.max_message + rng.randint(1, 4096)
        chunk = {"type": "response_chunk", "request_id": "r-x-1", "chunk": "y" * size}
        return Frame(_dump(chunk), "text", "over MAX_MESSAGE_BYTES", False)

    def damaged(self, own: str | None = None) -> Frame:
        roll = self.rng.random()
        if roll < 0.01:
            return self.huge()
        if roll < 0.55:
            return self.structural(own)
        return self.bytewise(own)
