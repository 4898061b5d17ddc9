"""Log lines both programs write: plain text, or one JSON object per line (``LOG_FORMAT``).

The server (``modelrelay_site.logformat``) and ``worker.py`` format their records with
these classes. A line about a request carries its id as ``request_id``: taken from the
record (``logger.info(..., extra={"request_id": rid})``) or, failing that, from
:data:`request_id` — the context variable the code serving one request sets in its own
task, so every line that task logs is tagged without passing the id around.

Log messages quote names that come from outside (provider, worker and model names,
paths); a newline in one of them could forge a second line. The text format escapes
control characters in the message; the JSON format cannot be forged that way (JSON
escapes them), and puts a traceback inside the object rather than after it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar
from typing import Any

#: The id of the request the current task serves (None outside one).
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

#: ``LOG_FORMAT`` values.
FORMATS = ("text", "json")

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u0085\u2028\u2029]")

#: Attributes of every LogRecord: anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]


def record_request_id(record: logging.LogRecord) -> str | None:
    """The request a record is about: its own ``request_id``, else the task's."""
    given = getattr(record, "request_id", None)
    return str(given) if given else request_id.get()


class OneLineFormatter(logging.Formatter):
    """The text format: one event, one line, whatever the event quotes. A traceback
    still follows on its own lines: it is the formatter's, not the message's."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if _CONTROL.search(message):
            record.message = _CONTROL.sub(_escape, message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
    ``logger``, ``message``, ``request_id`` for a line about a request, the fields
    passed with ``extra=`` (values JSON cannot hold become strings), and
    ``exception`` with the traceback text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": self._time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = record_request_id(record)
        if rid:
            document["request_id"] = rid
        for name, value in record.__dict__.items():
            if name not in _STANDARD and name not in document and not name.startswith("_"):
                document[name] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, ensure_ascii=False, default=str)

    @staticmethod
    def _time(record: logging.LogRecord) -> str:
        seconds = int(record.created)
        millis = int((record.created - seconds) * 1000)
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def formatter(kind: str, text_format: str) -> logging.Formatter:
    """The formatter for ``LOG_FORMAT=kind`` (``text`` uses ``text_format``)."""
    if kind == "json":
        return JsonFormatter()
    return OneLineFormatter(text_format)
