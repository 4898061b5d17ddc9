from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.live import LiveServer
from tests.live import live_server as _live_server

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
#: The Redis the tests use (RELAY_TEST_REDIS_URL points them at another one, e.g. a
#: private server when several runs share a machine: some tests flush it).
REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
_redis = urlsplit(REDIS_URL)
REDIS_HOST, REDIS_PORT = _redis.hostname or "127.0.0.1", _redis.port or 6379


def redis_url(db: int) -> str:
    """The tests' Redis, database ``db``."""
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"


def require_service(name: str, host: str, port: int) -> None:
    """Skip (on a developer machine) or fail (in CI) when a local service is absent."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return
    except OSError as exc:
        message = f"{name} is not reachable on {host}:{port} ({exc})"
        if IN_CI:
            pytest.fail(message + "; CI requires it", pytrace=False)
        pytest.skip(message)


def require_redis() -> None:
    """Skip (on a developer machine) or fail (in CI) without the tests' Redis."""
    require_service("Redis", REDIS_HOST, REDIS_PORT)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The PostgreSQL pass needs the server; without it, fail in CI and skip elsewhere."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.postgresql":
        return
    host, port = database.get("HOST") or "127.0.0.1", int(database.get("PORT") or 5432)
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        message = f"PostgreSQL is not reachable on {host}:{port} ({exc})"
        if IN_CI:
            pytest.exit(message + "; CI requires it", returncode=1)
        pytest.exit(message + "; skipping the PostgreSQL pass", returncode=0)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """A test database of this run's own on the shared PostgreSQL server: runs that
    overlap on one machine never share or drop each other's. (SQLite's is a file in
    DATA_DIR, each checkout its own; pytest-xdist's workers each add their suffix to it.)"""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.postgresql":
        database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_{os.getpid()}"


@pytest.fixture(scope="session", autouse=True)
def _close_database_pools(request: pytest.FixtureRequest) -> Iterator[None]:
    """Return pooled PostgreSQL connections before the test database is dropped."""
    from django.conf import settings

    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        yield
        return
    request.getfixturevalue("django_db_setup")  # so this teardown runs before its own
    yield
    from asgiref.sync import SyncToAsync
    from django.db import connections

    # Async ORM calls ran in asgiref's shared thread: release that thread's connection.
    SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=10)
    for connection in connections.all():
        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()


@pytest.fixture(scope="session", autouse=True)
def _worker_state_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Workers the tests start (in-process or as subprocesses, which inherit this) keep
    any credential in a directory of this run's own, never in the user's configuration
    directory, where a credential left by one run would be used by the next."""
    os.environ["WORKER_STATE_DIR"] = str(tmp_path_factory.mktemp("worker-state"))


@pytest.fixture
def relay_server_factory(
    tmp_path: Path,
) -> Iterator[Callable[..., AbstractContextManager[LiveServer]]]:
    """``with relay_server_factory(QUEUE_TIMEOUT_SECS="0.5") as server: ...``"""
    counter = iter(range(1000))

    def make(**env: str) -> AbstractContextManager[LiveServer]:
        return _live_server(tmp_path / f"server{next(counter)}", **env)

    yield make


@pytest.fixture
def relay_server(tmp_path: Path) -> Iterator[LiveServer]:
    with _live_server(tmp_path / "server") as server:
        yield server


@pytest.fixture
async def fresh_runtime() -> AsyncIterator[None]:
    """Give the test its own relay runtime and tear it down afterwards."""
    from relay.server import runtime

    await runtime.reset()
    yield
    await runtime.reset()
