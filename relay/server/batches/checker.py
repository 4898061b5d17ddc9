"""Where a batch's input is checked: a process of its own, never the server's.

Decoding JSON holds the interpreter for as long as one call takes, and a batch input
is large: a Message Batches body or an input file of BATCH_FILE_MAX_BYTES, one line of
MAX_REQUEST_BYTES (msgspec skips escape-heavy JSON at about 1 ms per MiB). A thread
would keep the event loop that streams everyone's tokens waiting for as long, so the
checks of :mod:`~relay.server.batches.lines` run in one long-lived process, started
at the first check (as the metrics federation's rendering does). The server process
only moves bytes: the input goes to the checker in a scratch file, the requests
come back in another, read one request at a time.

Scratch files live under ``DATA_DIR/scratch/<pid>/`` and are deleted after each
check; those of a process that was killed are removed when a server starts
(:func:`clean_scratch`). Calls block their (worker) thread, never the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from django.conf import settings

from relay.server.batches.lines import Checked

logger = logging.getLogger("relay.batches")
#: How often the checking process looks whether its server process is still there.
PARENT_POLL_SECS = 1.0


class Checker:
    """The checking process: one per server process (:data:`CHECKER`), started at the
    first check, kept for the next ones; it leaves with the server process, however
    that ends (:func:`watch_parent`)."""

    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, check: Callable[..., Checked], *args: Any) -> Checked:
        """``check(*args)`` in the checking process; from a worker thread."""
        try:
            with self._lock:
                if self._executor is None:
                    self._executor = ProcessPoolExecutor(
                        max_workers=1,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=watch_parent,
                        initargs=(os.getpid(),),
                    )
                future = self._executor.submit(check, *args)
        except (BrokenProcessPool, OSError) as exc:
            failed: BaseException = exc
        else:
            try:
                return future.result()
            except BrokenProcessPool as exc:
                failed = exc
        # Killed (out of memory?) or could not start: a new one next time, and this
        # check here rather than not at all.
        logger.warning("the batch checking process failed (%s); starting anew", failed)
        self.close()
        return check(*args)

    def close(self) -> None:
        """Stop the process (it failed, or the server process is ending)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


#: The server process's checker (engines come and go with runtimes; it stays).
CHECKER = Checker()


def watch_parent(parent: int) -> None:
    """In the checking process: leave as soon as the server process that started it
    is gone (killed: nothing else would tell this one, which waits for work)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECS)
        os._exit(0)

    threading.Thread(target=watch, name="parent watch", daemon=True).start()


def _root() -> Path:
    return Path(settings.DATA_DIR) / "scratch"


def scratch_paths() -> tuple[str, str]:
    """Two fresh paths in this process's scratch folder: a check's input, and the
    requests it writes. :func:`remove` them afterwards."""
    folder = _root() / str(os.getpid())
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = secrets.token_hex(8)
    return str(folder / f"{name}.in"), str(folder / f"{name}.out")


def remove(*paths: str) -> None:
    """Delete scratch files (in a worker thread: freeing a large file takes a while)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def scratch() -> Iterator[tuple[str, str]]:
    """:func:`scratch_paths`, removed on the way out (in a worker thread)."""
    paths = scratch_paths()
    try:
        yield paths
    finally:
        remove(*paths)


def clean_scratch() -> int:
    """Remove the scratch files of server processes that are gone (killed mid-check);
    returns how many folders went. Called when the batch engine starts."""
    root = _root()
    if not root.is_dir():
        return 0
    removed = 0
    for folder in root.iterdir():
        if folder.name.isdigit() and int(folder.name) != os.getpid() and not _alive(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
