"""Let daphne close worker sockets with the code and reason the application gives.

daphne (4.2.x) drops the ``reason`` of an ASGI ``websocket.close`` message and
hands the code to autobahn's ``sendClose``, which only allows 1000 and 3000-4999.
The protocol needs the standard codes too (1002 protocol error, 1008 policy,
1012 restart), each with a reason a worker can log. This wraps daphne's reply
handler so an application close goes out as exactly that close frame.

It also turns off autobahn's ``failByDrop``: a frame over MAX_MESSAGE_BYTES or
invalid UTF-8 then gets a proper close frame (1009/1007 with a reason) instead of
a dropped TCP connection the worker cannot explain.

And it stops two pieces of per-request Twisted work that daphne never uses: parsing
every POST body as a possible HTML form (the ``email`` package's header parser on each
Content-Type) — daphne hands the raw body to the application — and formatting an
access-log line for Twisted's legacy log, which daphne discards (it logs requests
itself).
Installed only when daphne is the server in this process.
"""

from __future__ import annotations

import sys
from typing import Any


def install() -> None:
    if "daphne.server" not in sys.modules:
        return
    from daphne.http_protocol import HTTPFactory, WebRequest

    HTTPFactory.log = lambda self, request: None
    from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol

    original_init = WebRequest.__init__

    def request_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = request_init

    if getattr(WebSocketProtocol, "_relay_close_frames", False):
        return
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
    WebSocketProtocol._relay_close_frames = True
