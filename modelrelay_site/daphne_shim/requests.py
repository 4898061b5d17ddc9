"""No per-request work daphne never uses.

Twisted parses every POST body as a possible HTML form (the ``email`` package's header
parser on each Content-Type), but daphne hands the raw body to the application; and
it formats an access-log line for Twisted's legacy log, which daphne discards (it logs
requests itself).
"""

from __future__ import annotations

from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def apply() -> None:
    from daphne.http_protocol import HTTPFactory, WebRequest

    HTTPFactory.log = lambda self, request: None
    original_init = WebRequest.__init__

    def request_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = request_init


PATCH = Patch(
    "no form parsing or access-log lines",
    ("daphne", "twisted"),
    (
        "daphne.http_protocol:HTTPFactory.log",
        "twisted.web.http:Request._parsePOSTFormSubmission",
    ),
    apply,
)
