"""Where the cluster's Redis is (SPEC §20): one URL, or a master found through Sentinel.

:class:`RedisTarget` is what the settings say (``REDIS_URL``, or ``REDIS_SENTINELS`` with
``REDIS_SENTINEL_MASTER``); :func:`parse_target` reads them and says clearly what is wrong.
:func:`channel_hosts` is the channel layer's entry for it; the connections themselves are
built by :class:`relay.server.cluster.redissource.RedisSource`. Read by the settings, so
it imports nothing of Django's.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

#: The default bound on one Redis call (REDIS_TIMEOUT_SECS).
TIMEOUT_SECS = 1.0
#: The most sentinels one process may be given (each is asked in turn).
MAX_SENTINELS = 16


def retry() -> Retry:
    """A call whose connection turned out broken (a pooled one Redis closed, a master
    that moved) is tried once more at once, on a new connection; a call that timed out
    is not: Redis is not answering, and the caller must hear it within the timeout
    (redis-py's default retries thrice with backoff, for up to seconds)."""
    return Retry(NoBackoff(), 1, (RedisConnectionError,))


class TargetError(ValueError):
    """The Redis settings contradict each other or cannot be read."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the cluster's Redis is: ``url``, or the master ``master`` that ``sentinels``
    watch (with ``password`` for the master and its replicas, ``sentinel_password`` for
    the sentinels, TLS to both when ``tls``)."""

    url: str = ""
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""
    password: str = ""
    sentinel_password: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    #: The longest one Redis call may wait for its reply.
    timeout: float = TIMEOUT_SECS

    @property
    def through_sentinel(self) -> bool:
        return bool(self.sentinels)

    def describe(self) -> str:
        """For logs and errors: where Redis is, never a password."""
        if self.through_sentinel:
            listed = ", ".join(f"{host}:{port}" for host, port in self.sentinels)
            return f"master {self.master!r} of the sentinels at {listed}"
        parts = urlsplit(self.url)
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return f"{parts.scheme}://{netloc}{parts.path}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        return ssl.create_default_context(cafile=self.tls_ca_file or None)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    # (ASCII digits only: str.isdigit() and int() take other scripts' digits too.)
    if not sep or not host or not re.fullmatch("[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise TargetError(f"REDIS_SENTINELS: {text!r} is not host:port")
    return host, int(port)


def parse_target(
    *,
    url: str = "",
    sentinels: list[str] | None = None,
    master: str = "",
    password: str = "",
    sentinel_password: str = "",
    tls: bool = False,
    tls_ca_file: str = "",
    timeout: float = TIMEOUT_SECS,
) -> RedisTarget | None:
    """The target the settings name, None when they name none (one process, no Redis).
    Raises :class:`TargetError` saying which settings conflict."""
    listed = [item for item in (sentinels or []) if item.strip()]
    if url and (listed or master):
        raise TargetError(
            "REDIS_URL and REDIS_SENTINELS/REDIS_SENTINEL_MASTER are exclusive: set REDIS_URL "
            "for one Redis, or REDIS_SENTINELS and REDIS_SENTINEL_MASTER for a master found "
            "through Sentinel"
        )
    if url:
        if tls or tls_ca_file or password:
            raise TargetError(
                "REDIS_PASSWORD and REDIS_TLS* go with REDIS_SENTINELS; with REDIS_URL put "
                "them in the URL (rediss://:password@host:port/0?ssl_ca_certs=...)"
            )
        return RedisTarget(url=url, timeout=timeout)
    if listed and not master:
        raise TargetError("REDIS_SENTINELS is set: REDIS_SENTINEL_MASTER must name the master")
    if master and not listed:
        raise TargetError("REDIS_SENTINEL_MASTER is set: REDIS_SENTINELS must list the sentinels")
    if not listed:
        if password or sentinel_password or tls or tls_ca_file:
            raise TargetError(
                "REDIS_PASSWORD, REDIS_SENTINEL_PASSWORD and REDIS_TLS* need REDIS_SENTINELS"
            )
        return None
    if len(listed) > MAX_SENTINELS:
        raise TargetError(f"REDIS_SENTINELS lists {len(listed)} sentinels; at most {MAX_SENTINELS}")
    return RedisTarget(
        sentinels=tuple(_address(item) for item in listed),
        master=master,
        password=password,
        sentinel_password=sentinel_password,
        tls=tls or bool(tls_ca_file),
        tls_ca_file=tls_ca_file,
        timeout=timeout,
    )


def tls_options(target: RedisTarget) -> dict[str, Any]:
    if not target.tls:
        return {}
    options: dict[str, Any] = {"ssl": True}
    if target.tls_ca_file:
        options["ssl_ca_certs"] = target.tls_ca_file
    return options


def sentinel_options(target: RedisTarget) -> dict[str, Any]:
    """How to talk to the sentinels themselves: each answer bounded by the timeout."""
    options: dict[str, Any] = {
        "socket_timeout": target.timeout,
        "socket_connect_timeout": target.timeout,
        "retry": Retry(NoBackoff(), 0),
        **tls_options(target),
    }
    if target.sentinel_password:
        options["password"] = target.sentinel_password
    return options


def channel_hosts(target: RedisTarget) -> list[dict[str, Any]]:
    """The channel layer's ``hosts`` (channels-redis): the URL, or the sentinels and the
    master's name (its pools then ask them at connect, as ours do). Without a socket
    timeout: its receivers block on Redis for seconds at a time by design; the control
    loop bounds them (:mod:`relay.server.cluster.control`)."""
    if not target.through_sentinel:
        return [{"address": target.url, "socket_timeout": None, "retry": retry()}]
    host: dict[str, Any] = {
        "sentinels": list(target.sentinels),
        "master_name": target.master,
        "sentinel_kwargs": sentinel_options(target),
        "socket_timeout": None,
        "retry": retry(),
        "socket_connect_timeout": target.timeout,
        **tls_options(target),
    }
    if target.password:
        host["password"] = target.password
    return [host]
