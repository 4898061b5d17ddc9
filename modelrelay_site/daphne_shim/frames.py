"""Lean WebSocket frame handling.

Per incoming frame, autobahn sets up a native masker and, per message, fires its
``message`` event through a chain of Deferreds that nobody listens to here; and it
formats the arguments of a debug line on every read and every frame sent, whether or
not anything logs it. Small frames get :class:`SmallMasker`, messages without listeners
skip the event, and reads and sends skip the debug line.
"""

from __future__ import annotations

from typing import Any

from modelrelay_site.daphne_shim.probe import Patch

#: Frames up to this size are unmasked in Python: faster than setting up autobahn's
#: native masker, which pays off only for larger payloads.
SMALL_FRAME = 1024


class SmallMasker:
    """Unmasks a small frame's payload (RFC 6455 §5.3), possibly in several pieces."""

    __slots__ = ("_mask", "_ptr")

    def __init__(self, mask: bytes) -> None:
        self._mask = mask
        self._ptr = 0

    def pointer(self) -> int:
        return self._ptr

    def reset(self) -> None:
        self._ptr = 0

    def process(self, data: bytes) -> bytes:
        size = len(data)
        if not size:
            return b""
        shift = self._ptr & 3
        mask = self._mask[shift:] + self._mask[:shift]
        key = (mask * ((size >> 2) + 1))[:size]
        self._ptr += size
        return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(
            size, "little"
        )


def apply() -> None:
    from autobahn.websocket import protocol as autobahn_protocol
    from daphne.ws_protocol import WebSocketProtocol

    protocol_class: Any = WebSocketProtocol

    native = autobahn_protocol.create_xor_masker

    def create_xor_masker(mask: bytes, length: int | None = None) -> Any:
        if length is not None and length <= SMALL_FRAME:
            return SmallMasker(bytes(mask))
        return native(mask, length)

    autobahn_protocol.create_xor_masker = create_xor_masker
    original_end = protocol_class.onMessageEnd

    def on_message_end(self: Any) -> None:
        if self.trackedTimings or getattr(self, "_listeners", None) or self._parent is not None:
            original_end(self)
            return
        if not self.failedByMe:
            self._onMessage(b"".join(self.message_data), self.message_is_binary)
        self.message_data = None

    protocol_class.onMessageEnd = on_message_end

    def data_received(self: Any, data: bytes) -> None:
        # autobahn's own formats the arguments of a debug line first (class names,
        # terminal colours) on every read, whether or not anything logs it.
        self._dataReceived(data)

    protocol_class.dataReceived = data_received
    original_send = protocol_class.sendData

    def send_data(self: Any, data: bytes, sync: bool = False, chopsize: int | None = None) -> None:
        # Likewise for every frame sent, when nothing is queued or chopped.
        if sync or chopsize or self.send_queue or self.logOctets or self.state != self.STATE_OPEN:
            original_send(self, data, sync, chopsize)
            return
        self.transport.write(data)
        self.trafficStats.outgoingOctetsWireLevel += len(data)

    protocol_class.sendData = send_data


PATCH = Patch(
    "lean frames",
    ("autobahn", "daphne"),
    (
        "autobahn.websocket.protocol:create_xor_masker",
        "daphne.ws_protocol:WebSocketProtocol.onMessageEnd",
        "daphne.ws_protocol:WebSocketProtocol._onMessage",
        "daphne.ws_protocol:WebSocketProtocol.dataReceived",
        "daphne.ws_protocol:WebSocketProtocol._dataReceived",
        "daphne.ws_protocol:WebSocketProtocol.sendData",
        "daphne.ws_protocol:WebSocketProtocol.trackedTimings",
        "daphne.ws_protocol:WebSocketProtocol.failedByMe",
        "daphne.ws_protocol:WebSocketProtocol.send_queue",
        "daphne.ws_protocol:WebSocketProtocol.logOctets",
        "daphne.ws_protocol:WebSocketProtocol.trafficStats",
        "daphne.ws_protocol:WebSocketProtocol.message_data",
        "daphne.ws_protocol:WebSocketProtocol.message_is_binary",
        "daphne.ws_protocol:WebSocketProtocol.STATE_OPEN",
    ),
    apply,
)
