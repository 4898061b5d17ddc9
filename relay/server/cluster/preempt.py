"""Priority classes across server processes (SPEC §15): a request above ``flex`` that
finds no free slot anywhere asks every process for a ``flex`` request that may lose its
slot; the first process to claim the ask preempts one of its own (it owns that request,
so it is the one that can put it back in the queue).

:class:`ClusterPreemption` is a base of :class:`relay.server.cluster.placement.RedisPlacement`.
If the ask is lost, nothing is preempted: the request simply waits its turn, which the
shared queue gives by class.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import TYPE_CHECKING

from relay.core.relay import Relay
from relay.core.state import RelayRequest
from relay.server.cluster.proxy import ProxyPool
from relay.server.cluster.state import ClusterState

logger = logging.getLogger("relay.cluster")


class ClusterPreemption:
    if TYPE_CHECKING:  # provided by the placement
        relay: Relay
        state: ClusterState
        proxies: ProxyPool
        instance: str
        _asks: itertools.count[int]

        def _entry(self, request: RelayRequest) -> str: ...

    async def _want_slot(self, request: RelayRequest) -> None:
        """A request above ``flex`` found no free slot anywhere: give it the slot of a
        ``flex`` request this process owns if one may lose it, else ask every process
        (the first to answer acts). If the message is lost nothing is preempted; the
        request simply waits its turn."""
        victim = self._victim(request.provider, request.model)
        if victim is not None:
            self.relay.preempt(victim, f"{request.id} ({request.service_class})")
            return
        token = f"{self._entry(request)}|{next(self._asks)}"
        message = json.dumps([request.provider, request.model, token])
        await self.state.broadcast(f"preempt {message}")

    async def _preempt_for(self, text: str) -> None:
        try:
            provider, model, token = json.loads(text)
        except (ValueError, TypeError):
            logger.warning("cluster: malformed preemption message %r", text[:200])
            return
        if self._victim(provider, model) is None:
            return
        if not await self.state.claim(token, self.instance):
            return  # another process answered first
        victim = self._victim(provider, model)  # (it may have moved on meanwhile)
        if victim is not None:
            self.relay.preempt(victim, f"a request of a higher class at {token.split('|')[0]}")

    def _victim(self, provider: str, model: str) -> RelayRequest | None:
        workers = [
            worker
            for worker in (*self.relay.registry.workers.values(), *self.proxies.stand_ins.values())
            if worker.provider == provider
        ]
        return self.relay.preemptible(workers, model)
