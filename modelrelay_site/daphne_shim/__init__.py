"""What ModelRelay changes in daphne, Twisted and autobahn when daphne is the server.

Each change is a :class:`Patch` in a module of its own, named after what it gives:

- ``closeframes``: worker sockets close with the code and reason the application gives
  (1002, 1008, 1012 ...), and an oversized or invalid frame gets a close frame, not a
  dropped connection;
- ``requests``: no per-request work daphne never uses (HTML form parsing of POST
  bodies, Twisted's access-log line);
- ``reaping``: a finished request leaves daphne's connection table at once;
- ``backpressure``: a streamed body part's ``send`` waits while the client's
  connection is full, as under uvicorn;
- ``refusals``: 431 for oversized headers, and a request that will be refused anyway
  answered before its body is read (and a chunked body cut off at its limit), on every
  route (:mod:`relay.server.http.early` decides);
- ``uploads``: the same for the batch routes (a file upload over its size limit, any
  body without a valid key);
- ``directio``: socket writes and readiness callbacks without Twisted's extra loop turn
  and log context;
- ``frames``: lean WebSocket frame handling (small frames unmasked in Python, no
  event chain nobody listens to, no debug-line formatting per frame).

Every patch reaches into private names of those packages, which an upgrade may rename.
So before applying one, :func:`install` checks that each name it relies on is still
there and that the installed versions are the ones the test suite ran against
(:data:`~modelrelay_site.daphne_shim.probe.TESTED`); otherwise that patch is left out,
with one warning naming it, and daphne's own behaviour stands.
``DAPHNE_SHIM_UNTESTED=apply`` applies patches on untested versions anyway (their
names still probed); ``DAPHNE_SHIM_SKIP`` (patch names, or ``all``) leaves patches out.
"""

from __future__ import annotations

import logging
import sys

from modelrelay_site.daphne_shim import (
    backpressure,
    closeframes,
    directio,
    frames,
    reaping,
    refusals,
    requests,
    uploads,
)
from modelrelay_site.daphne_shim.probe import Patch, problem

logger = logging.getLogger("relay.daphne")


def patches() -> list[Patch]:
    return [
        closeframes.PATCH,
        frames.PATCH,
        requests.PATCH,
        reaping.PATCH,
        backpressure.PATCH,
        refusals.PATCH,
        uploads.PATCH,
        directio.PATCH,
    ]


#: Names of the patches in effect in this process (for logs and tests).
applied: list[str] = []


def install(candidates: list[Patch] | None = None) -> list[str]:
    """Apply every patch whose targets are all present (once per process); returns the
    names of those left out. Does nothing unless daphne is the server."""
    if "daphne.server" not in sys.modules:
        return []
    from django.conf import settings

    skipped = []
    for patch in patches() if candidates is None else candidates:
        if patch.name in applied:
            continue
        why = problem(patch, skip=settings.DAPHNE_SHIM_SKIP, untested=settings.DAPHNE_SHIM_UNTESTED)
        if why is not None:
            logger.warning(
                "daphne shim: %r left out, daphne's own behaviour stands (%s)", patch.name, why
            )
            skipped.append(patch.name)
            continue
        patch.apply()
        applied.append(patch.name)
    return skipped
