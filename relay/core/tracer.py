"""What the core tells a tracer about a request (SPEC §17); no tracing library here.

:attr:`relay.core.dispatch.Dispatcher.tracer` is None unless tracing is on (the server
sets it to :class:`relay.server.tracing.Tracing`), so with tracing off every hook costs
one ``is None`` test. A request the edge traces carries its trace state in
:attr:`relay.core.state.RelayRequest.trace`, handed to ``submit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from relay.core.state import RelayRequest, Worker


class RequestTracer(Protocol):
    def dispatched(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        """``request`` is being sent to ``worker`` (``now``: loop time; its queue stint,
        if any, is still open). Returns the headers for the ``request`` frame: the
        request's own, plus the trace context the worker continues."""
        ...

    def finished(self, request: RelayRequest) -> None:
        """``request`` ended (status, outcome, tokens and times are final)."""
        ...
