"""Whether a streamed answer reached its own end, or the backend stopped it short.

A backend may end a stream's HTTP body cleanly although the answer is not finished:
llama-server's router does when its model is unloaded mid-stream (``POST
/models/unload``, or a load that evicts it), and the client would see its stream stop
with neither an error nor the API's last event. Each API ends a finished stream with an
event of its own, so :meth:`relay.worker.backend.Backend.exchange` feeds every read of a
stream to a :class:`StreamEnd` and, when the body ended without that event, ends the
stream with the endpoint's error event and reports the request failed (502), as for a
stream that broke off. Imports nothing from Django.

The events (OpenAI, Anthropic and the Responses API; llama-server, vLLM and Ollama
follow them): ``data: [DONE]`` for chat and legacy completions, ``message_stop`` for
Anthropic messages, ``response.completed`` (or ``response.incomplete`` /
``response.failed``, which say themselves how the answer ended) for the Responses API.
"""

from __future__ import annotations

import re

#: Endpoint -> what its last event holds. Other endpoints' streams are not checked.
_LAST_EVENT = {
    "/v1/chat/completions": re.compile(rb"(?:^|\n)data: ?\[DONE\]"),
    "/v1/completions": re.compile(rb"(?:^|\n)data: ?\[DONE\]"),
    "/v1/messages": re.compile(rb'"type" ?: ?"message_stop"'),
    "/v1/responses": re.compile(rb'"type" ?: ?"response\.(?:completed|incomplete|failed)"'),
}
#: Bytes of one read kept for the next, so that a marker split across reads is seen:
#: longer than any of them.
_OVERLAP = 64


class StreamEnd:
    """Fed each read of one stream; :attr:`reached` once its last event went by."""

    __slots__ = ("_marker", "_tail", "reached")

    def __init__(self, endpoint_path: str) -> None:
        marker = _LAST_EVENT.get(endpoint_path)
        self._marker = marker
        #: True from the start for a stream whose end is not checked.
        self.reached = marker is None
        self._tail = b"\n\n"

    @staticmethod
    def checks(endpoint_path: str) -> bool:
        return endpoint_path in _LAST_EVENT

    @property
    def between_events(self) -> bool:
        """Whether what was fed so far ends with a whole event (or nothing was fed):
        an event written now reaches the client as an event of its own. Otherwise it
        must follow a blank line, or the client would read it as part of the torn one
        (llama-server's router ends a stream it cuts with a bare ``proxy error: …``)."""
        return self._tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r"))

    def feed(self, data: bytes) -> None:
        if not data:
            return
        marker = self._marker
        # The read alone, then the seam with the one before (no copy of the whole read).
        if (
            not self.reached
            and marker is not None
            and (
                marker.search(data) is not None
                or marker.search(self._tail + data[:_OVERLAP]) is not None
            )
        ):
            self.reached = True
        self._tail = data[-_OVERLAP:] if len(data) >= _OVERLAP else (self._tail + data)[-_OVERLAP:]
