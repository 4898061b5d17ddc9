"""The access log: one line per finished request in the server's log (``ACCESS_LOG``).

:class:`AccessLog` is a request observer of the relay core: the dispatcher calls it
with the :class:`~relay.core.stats.RequestRecord` of every request that ends — served,
failed by the backend, cancelled by its client — and of every request refused before
admission (bad body, unknown model, a key over its limits). On the event loop it only
names the request's key and puts the record in a bounded queue; one thread of the
process turns the queued records into lines of the ``relay.access`` logger (INFO,
formatted by ``LOG_FORMAT`` like every other line), so the loop relaying tokens
neither builds the lines nor waits on a slow log stream: every :data:`BATCH_SECS` the
thread writes what gathered, to a stream in one write. When it falls more than
:data:`MAX_PENDING` lines behind, new lines are dropped and counted, and the next
batch says how many.

A line carries: ``method`` and ``path`` (the API routes take POST; a 405 refusal's
method is not recorded, ``-``), ``status``, ``outcome``, ``model``, ``key`` (its name,
never the secret), ``worker``, ``class`` (the priority class) and ``preemptions``,
``queue_ms``, ``first_byte_ms``, ``duration_ms``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``tokens_estimated``, ``streamed``,
``cancel_reason``, ``role`` (cluster mode: ``origin`` or ``worker``, each process
writes its line) and ``request_id``. With ``LOG_FORMAT=json`` they are fields of the
object (``message`` is ``"POST /v1/chat/completions 200 ok"``); with ``text`` the
message is the whole line, ``name=value`` (``-`` when absent, values with spaces or
quotes JSON-quoted). A refusal has no request id, worker, class or timings.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import threading
import time
from collections import deque
from typing import Any

from relay.core.keycache import KeyCache
from relay.core.keystats import key_name
from relay.core.stats import RequestRecord

logger = logging.getLogger("relay.access")

#: Lines the writing thread may fall behind before new ones are dropped.
MAX_PENDING = 10_000
#: The thread writes what gathered at most this often: a line is in the log at most
#: about this long after its request ended.
BATCH_SECS = 0.05
#: The fields of a text line after ``method path status outcome``, in order (those
#: named in :data:`_WHEN_SET` only when they say something).
_TEXT_FIELDS = (
    "model",
    "key",
    "worker",
    "class",
    "preemptions",
    "queue_ms",
    "first_byte_ms",
    "duration_ms",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cancel_reason",
    "role",
    "request_id",
)
_WHEN_SET = frozenset({"preemptions", "cached_tokens", "cancel_reason", "role"})

#: What the observer queues: the record, its key's name, when it ended, json or not.
_Item = tuple[RequestRecord, str | None, float, bool]


class AccessLog:
    """The request observer writing the access log (registered by the runtime when
    ``ACCESS_LOG`` is on)."""

    def __init__(self, keys: KeyCache, *, json_lines: bool) -> None:
        self.keys = keys
        self.json_lines = json_lines

    def observe(self, record: RequestRecord) -> None:
        """Called by the dispatcher as a request ends or is refused: queue its line.
        Never blocks, never raises for a full queue."""
        key = None if record.key_id is None else key_name(self.keys, record.key_id)
        _writer().put((record, key, time.time(), self.json_lines))


def fields(record: RequestRecord, key: str | None) -> dict[str, Any]:
    """The line's fields (None: not known for this request)."""
    refused = not record.request_id  # refused before admission: nothing ran
    return {
        "method": "-" if record.status == 405 else "POST",
        "path": record.endpoint,
        "status": record.status,
        "outcome": record.outcome,
        "model": record.model or None,
        "key": key,
        "worker": record.worker_name,
        "class": None if refused else record.service_class,
        "preemptions": record.preemptions,
        "queue_ms": None if refused else _ms(record.queue_wait),
        "first_byte_ms": None if record.ttfb is None else _ms(record.ttfb),
        "duration_ms": None if refused else _ms(record.duration),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
        "tokens_estimated": record.tokens_estimated,
        "streamed": record.streamed,
        "cancel_reason": record.cancel_reason,
        "role": record.relay_role or None,
        "request_id": record.request_id or None,
    }


def text_line(line: dict[str, Any]) -> str:
    """The text format's message: ``POST /v1/... 200 ok model=... request_id=r-...``."""
    parts = [
        line["method"],
        _shown(line["path"]),
        str(line["status"]),
        _shown(line["outcome"]),
    ]
    for name in _TEXT_FIELDS:
        value = line[name]
        if name in _WHEN_SET and not value:
            continue
        parts.append(f"{name}={_shown(value)}")
    return " ".join(parts)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


_QUOTED = re.compile(r'[\s"=]')


def _shown(value: object) -> str:
    if value is None:
        return "-"
    text = str(value)
    if not text or _QUOTED.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class _Writer:
    """The process's access-log thread: queued records become ``relay.access`` lines.
    One per process (runtimes come and go with event loops; the log does not); the
    lines still queued are written when the interpreter exits."""

    def __init__(self) -> None:
        # A deque and an event rather than a queue.Queue: appending takes no lock, and
        # the thread is woken at most every BATCH_SECS (by the first line after it
        # found the deque empty), not per line: each wake-up hands the GIL over
        # between threads, which costs more than writing a line.
        self._pending: deque[_Item] = deque()
        self._wake = threading.Event()
        self._closing = False
        #: Lines dropped for a full queue (counted by the loop), and how many of them
        #: the log has said (by the thread): each side writes only its own.
        self.dropped = 0
        self._said = 0
        self._thread = threading.Thread(target=self._run, name="relay-access-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def put(self, item: _Item) -> None:
        pending = self._pending
        if len(pending) >= MAX_PENDING:
            self.dropped += 1
            return
        pending.append(item)
        if len(pending) == 1:
            self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued, then stop (at exit; bounded)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        pending = self._pending
        while True:
            self._wake.wait()
            if not self._closing:
                time.sleep(BATCH_SECS)  # let the burst gather
            self._wake.clear()
            entries = []
            while pending:
                try:
                    entries.append(self._entry(*pending.popleft()))
                except Exception:  # a bad line must not end the log
                    logging.getLogger("relay.runtime").exception("access log line failed")
            if entries and logger.isEnabledFor(logging.INFO):
                self._emit(entries)
            if self._closing:
                return

    def _entry(
        self, record: RequestRecord, key: str | None, ended: float, as_json: bool
    ) -> logging.LogRecord:
        line = fields(record, key)
        if as_json:
            message = f"{line['method']} {line['path']} {line['status']} {line['outcome']}"
            extra = line
        else:
            message, extra = text_line(line), {}
        entry = logger.makeRecord(logger.name, logging.INFO, __file__, 0, message, (), None)
        entry.__dict__.update(extra)
        entry.created = ended
        entry.msecs = (ended - int(ended)) * 1000
        return entry

    def _emit(self, entries: list[logging.LogRecord]) -> None:
        """Hand a batch of lines to the access logger's handlers: to a stream in one
        write (a system call is where the GIL changes threads: once per batch, not per
        line), to any other handler (or a logger that propagates) line by line."""
        dropped = self.dropped
        if dropped > self._said:
            entries.insert(0, self._dropped_entry(dropped - self._said))
            self._said = dropped
        handlers = logger.handlers
        streams = [h for h in handlers if isinstance(h, logging.StreamHandler) and h.stream]
        if logger.propagate or len(streams) != len(handlers):
            for entry in entries:
                logger.handle(entry)
            return
        for handler in streams:
            kept = [e for e in entries if e.levelno >= handler.level and handler.filter(e)]
            if not kept:
                continue
            try:
                text = "".join(handler.format(e) + handler.terminator for e in kept)
                with handler.lock:  # type: ignore[union-attr]  # made by Handler.__init__
                    handler.stream.write(text)
                    handler.flush()
            except Exception:
                handler.handleError(kept[0])

    @staticmethod
    def _dropped_entry(count: int) -> logging.LogRecord:
        message = (
            f"access log: {count} lines dropped (requests ended faster than the log was written)"
        )
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)


_shared: _Writer | None = None
_lock = threading.Lock()


def _writer() -> _Writer:
    global _shared
    if _shared is None:
        with _lock:
            if _shared is None:
                _shared = _Writer()
    return _shared
