"""The one interface the Django apps (admin, signals, services, commands) use to reach
the running relay.

Everything here is thread-safe: it is called from whatever thread saved a row or
served an admin page, never on the relay's own event loop (except the coroutines,
which run on it). Changes reach this process's runtime directly and, with Redis,
every other process through the channel layer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings

from relay.server import runtime as _runtime
from relay.server.cluster.control import GROUP, ClusterUnreachable
from relay.server.cluster.redissource import MasterUnknown, check_master

__all__ = ["ClusterUnreachable"]

logger = logging.getLogger("relay.runtime")

#: The close reason workers see when an operator rotates their provider's secret and
#: disconnects them.
SECRET_ROTATED = _runtime.SECRET_ROTATED


def redis_problem() -> str | None:
    """At start, before serving: what is wrong with the Redis settings that retrying
    cannot mend (a master name no sentinel monitors), or None. Sentinels that cannot be
    reached are no problem here: the server starts degraded and keeps asking."""
    if settings.REDIS_TARGET is None:
        return None
    try:
        check_master(settings.REDIS_TARGET)
    except MasterUnknown as exc:
        return str(exc)
    return None


async def workers() -> list[dict[str, object]]:
    """Connected workers (of every process with Redis); on the relay's loop."""
    return await _runtime.current().workers()


async def drain(worker_id: str, *, drain_secs: float | None = None, reason: str) -> bool:
    """Drain a worker connected to any process; on the relay's loop. Raises
    :class:`ClusterUnreachable` when the other processes cannot be asked."""
    return await _runtime.current().drain(worker_id, drain_secs=drain_secs, reason=reason)


async def refresh(worker_id: str, *, reason: str) -> bool:
    """Ask a worker connected to any process for its models; on the relay's loop. Raises
    :class:`ClusterUnreachable` when the other processes cannot be asked."""
    return await _runtime.current().refresh(worker_id, reason=reason)


def providers_changed() -> None:
    """Thread-safe: make every server process reload providers and keys now.

    Called from Django signals, in whatever thread saved the row (an admin request,
    a management command). This process is poked directly; with Redis, all the
    others are told through the channel layer.
    """
    rt = _runtime.peek()
    if rt is not None and not rt.loop.is_closed():
        try:
            rt.loop.call_soon_threadsafe(rt.poke)
        except RuntimeError:  # loop closed between the check and the call
            rt = None
    if settings.REDIS_TARGET is None:
        return
    try:
        if rt is not None and rt.cluster is not None:
            future = asyncio.run_coroutine_threadsafe(rt.cluster.broadcast_sync(), rt.loop)
            future.add_done_callback(_log_failure)
        else:  # no server loop in this process (a management command)
            from asgiref.sync import async_to_sync
            from channels.layers import get_channel_layer

            layer = get_channel_layer()
            if layer is not None:
                async_to_sync(layer.group_send)(GROUP, {"type": "relay.sync"})
    except Exception:
        logger.warning("could not broadcast a provider/key change through Redis", exc_info=True)


def disconnect_provider(provider: str, reason: str = SECRET_ROTATED) -> int:
    """Thread-safe: close every worker of ``provider`` on every server process (1008).

    Called from sync code (the admin, the wizard) in a thread other than the server's
    loop, after a secret rotation was committed. Returns how many workers were told to
    close. A process without a running relay (a management command) can only broadcast
    through Redis, and counts nothing.
    """
    rt = _runtime.peek()
    if rt is not None and rt.loop.is_running():
        try:
            on_loop = asyncio.get_running_loop() is rt.loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # blocking on our own loop would never return
            raise RuntimeError("disconnect_provider() called on the relay's event loop")
        future = asyncio.run_coroutine_threadsafe(rt.disconnect_provider(provider, reason), rt.loop)
        return future.result(timeout=10)
    if settings.REDIS_TARGET is not None:
        from asgiref.sync import async_to_sync
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is not None:
            message = {"type": "relay.disconnect_provider", "provider": provider, "reason": reason}
            async_to_sync(layer.group_send)(GROUP, message)
    return 0


def _log_failure(future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        logger.warning("could not broadcast a provider/key change through Redis: %s", exc)


keys_changed = providers_changed
