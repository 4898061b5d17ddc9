"""File uploads refused before their body: a declared length over the limit, or no
valid API key, answered as soon as the headers are in.

Twisted reads (and spools to disk) a whole request body before daphne hands the
request to the application; for ``POST /v1/files`` that could be a hundred
megabytes refused anyway. The checks are the application's own
(:func:`relay.server.http.app.refused_before_body`); it makes them again for every
request that gets through, as it does under uvicorn, which hands requests over
before their body.
"""

from __future__ import annotations

import functools
from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


@functools.cache
def _check() -> Any:
    """The application's check, imported once (Django is set up by then)."""
    from relay.server.http.app import refused_before_body

    return refused_before_body


def apply() -> None:
    from twisted.web import http

    from modelrelay_site.daphne_shim.refusals import _refusal, _refuse

    HTTPChannel: Any = http.HTTPChannel
    original = HTTPChannel.allHeadersReceived

    def all_headers_received(self: Any) -> None:
        if self.length != 0 and self._command == b"POST":
            path = self._path.split(b"?", 1)[0].decode("latin-1")
            request = self.requests[-1]
            headers = [
                (name.lower(), value)
                for name, values in request.requestHeaders.getAllRawHeaders()
                for value in values
            ]
            refused = _check()("POST", path, headers)
            if refused is not None:
                err, flavor = refused
                self._relay_refused = True
                _refuse(self, _refusal(err, flavor))
                return
        original(self)

    HTTPChannel.allHeadersReceived = all_headers_received


PATCH = Patch(
    "early upload refusals",
    ("daphne", "twisted"),
    (
        "twisted.web.http:HTTPChannel.allHeadersReceived",
        "twisted.web.http:HTTPChannel.length",
        "twisted.web.http:HTTPChannel.requests",
        "twisted.web.http:HTTPChannel._path",
        "twisted.web.http:HTTPChannel._command",
        "twisted.web.http:HTTPChannel.loseConnection",
        "modelrelay_site.daphne_shim.refusals:_refuse",
        "modelrelay_site.daphne_shim.refusals:_refusal",
    ),
    apply,
)
