"""The server's log formats, chosen by ``LOG_FORMAT`` (see :mod:`relay.wire.logrecord`,
which the worker shares): ``text``, one event per line with control characters in the
message escaped, or ``json``, one object per line with ``request_id`` on every line
about a request."""

from __future__ import annotations

from relay.wire.logrecord import JsonFormatter, OneLineFormatter

__all__ = ["JsonFormatter", "OneLineFormatter"]
