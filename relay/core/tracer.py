"""What the core tells a tracer about a request (SPEC §17); no tracing library here.

:attr:`relay.core.dispatch.Dispatcher.tracer` is a :class:`NullTracer` unless tracing
is on (the server then sets :class:`relay.server.tracing.Tracing`), so the request path
calls its hooks unconditionally and with tracing off each costs one method call. A
request the edge traces carries its trace state in
:attr:`relay.core.state.RelayRequest.trace`, handed to ``submit``.

A tracer's hooks never raise: a failure to record a span must not change what happens
to the request.
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

    def hedged(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        """``request`` is also being sent to ``worker``, a second attempt (SPEC §21,
        hedging) beside the one dispatched. Returns the headers for its ``request``
        frame, as :meth:`dispatched` does."""
        ...

    def finished(self, request: RelayRequest) -> None:
        """``request`` ended (status, outcome, tokens and times are final)."""
        ...


class NullTracer:
    """Tracing off: nothing recorded, and a worker gets the request's own headers."""

    __slots__ = ()

    def dispatched(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        return request.headers

    def hedged(self, request: RelayRequest, worker: Worker, now: float) -> dict[str, str]:
        return request.headers

    def finished(self, request: RelayRequest) -> None:
        pass
