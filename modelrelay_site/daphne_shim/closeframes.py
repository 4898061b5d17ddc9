"""Worker sockets close with the application's code and reason.

daphne (4.2.x) drops the ``reason`` of an ASGI ``websocket.close`` message and hands
the code to autobahn's ``sendClose``, which only allows 1000 and 3000-4999. The
protocol needs the standard codes too (1002 protocol error, 1008 policy, 1012
restart), each with a reason a worker can log: an application close goes out as
exactly that close frame. And autobahn's ``failByDrop`` is off: a frame over
MAX_MESSAGE_BYTES or invalid UTF-8 then gets a proper close frame (1009/1007 with a
reason) instead of a dropped TCP connection the worker cannot explain.
"""

from __future__ import annotations

from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def apply() -> None:
    from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol

    original = WebSocketProtocol.handle_reply
    original_options = WebSocketFactory.setProtocolOptions

    def set_protocol_options(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("failByDrop", False)
        original_options(self, *args, **kwargs)

    def handle_reply(self: Any, message: dict[str, Any]) -> None:
        if message.get("type") == "websocket.close" and self.state != self.STATE_CONNECTING:
            reason = message.get("reason") or ""
            self.sendCloseFrame(
                code=message.get("code") or 1000,
                reasonUtf8=reason.encode()[:123] or None,
                isReply=False,
            )
            return
        original(self, message)

    WebSocketProtocol.handle_reply = handle_reply
    WebSocketFactory.setProtocolOptions = set_protocol_options


PATCH = Patch(
    "close frames",
    ("daphne", "autobahn"),
    (
        "daphne.ws_protocol:WebSocketProtocol.handle_reply",
        "daphne.ws_protocol:WebSocketProtocol.STATE_CONNECTING",
        "daphne.ws_protocol:WebSocketProtocol.sendCloseFrame",
        "daphne.ws_protocol:WebSocketFactory.setProtocolOptions",
    ),
    apply,
)
