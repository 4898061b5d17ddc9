"""The server's log format: one event, one line, whatever the event quotes.

Log messages quote names that come from outside (provider and worker names, model
names, paths); a newline in one of them could forge a second log line. The
formatter escapes control characters in the message itself. A traceback still
follows on its own lines: it is the formatter's, not the message's.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u0085\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if _CONTROL.search(message):
            record.message = _CONTROL.sub(_escape, message)
        return super().formatMessage(record)
