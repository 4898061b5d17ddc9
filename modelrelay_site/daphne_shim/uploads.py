"""The batch routes refused before their body, as soon as the headers are in: a wrong
method or path, no valid key, a wrong content type, a declared length over the
route's own limit (an upload's, a batch creation's, a Message Batch's, none for a
route that reads no body). In the first moments after a start, before the API keys
are loaded, the connection is not read further until they are (then the verdict).

Twisted reads (and spools to disk) a whole request body before daphne hands the
request to the application; for ``POST /v1/files`` that could be a hundred
megabytes refused anyway. The checks are the application's own
(:func:`relay.server.http.app.refused_before_body`); it makes them again for every
request that gets through, as it does under uvicorn, which hands requests over
before their body. A chunked body is cut off at the upload limit.
"""

from __future__ import annotations

from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def apply() -> None:
    from twisted.web import http

    from modelrelay_site.daphne_shim.refusals import (
        WAIT,
        _refuse,
        early_refusal,
        not_ready,
        wait_for_keys,
    )

    HTTPChannel: Any = http.HTTPChannel
    original = HTTPChannel.allHeadersReceived

    def all_headers_received(self: Any, *, waited: bool = False) -> None:
        response = early_refusal(self, batches=True)
        if response is WAIT:
            if not waited:
                wait_for_keys(self, lambda: all_headers_received(self, waited=True))
                return
            response = not_ready()
        if response is not None:
            self._relay_refused = True
            _refuse(self, response)
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
        "modelrelay_site.daphne_shim.refusals:early_refusal",
        "modelrelay_site.daphne_shim.refusals:wait_for_keys",
        "twisted.web.http:HTTPChannel.rawDataReceived",
    ),
    apply,
)
