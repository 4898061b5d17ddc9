"""A finished request leaves daphne's connection table at once, not at the next sweep."""

from __future__ import annotations

from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def apply() -> None:
    """Forget a finished request's connection entry at once, not on the next sweep.

    daphne keeps an entry per HTTP request (keep-alive requests included) in
    ``Server.connections`` until ``application_checker``, once a second, sees both
    its application finished and its protocol gone. Under load that is thousands of
    finished requests (their Twisted request objects, headers and application
    futures) kept alive and walked every second. Here an entry whose application
    ended cleanly is dropped the moment the second of the two happens; the
    sweep still handles everything else as before (applications that raised, were
    cancelled, or outlive their client).
    """
    from daphne.server import Server

    original_create = Server.create_application
    original_disconnected = Server.protocol_disconnected

    def reap(server: Any, protocol: Any) -> None:
        details = server.connections.get(protocol)
        if details is None or "disconnected" not in details:
            return
        instance = details.get("application_instance")
        if instance is None or not instance.done() or instance.cancelled():
            return
        if instance.exception() is None:
            del server.connections[protocol]

    def create_application(self: Any, protocol: Any, scope: Any) -> Any:
        queue = original_create(self, protocol, scope)
        if queue is not None:  # None: the client left before the application started
            instance = self.connections[protocol]["application_instance"]
            instance.add_done_callback(lambda _: reap(self, protocol))
        return queue

    def protocol_disconnected(self: Any, protocol: Any) -> None:
        if protocol in self.connections:  # a second call for a reaped entry is a no-op
            original_disconnected(self, protocol)
            reap(self, protocol)

    Server.create_application = create_application
    Server.protocol_disconnected = protocol_disconnected


PATCH = Patch(
    "prompt reaping",
    ("daphne",),
    (
        "daphne.server:Server.create_application",
        "daphne.server:Server.protocol_disconnected",
        "daphne.server:Server.connections",
        "daphne.server:Server.application_checker",
    ),
    apply,
)
