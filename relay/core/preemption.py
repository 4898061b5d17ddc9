"""Preempt and requeue (SPEC §15): a ``priority`` or ``default`` request that finds no
free slot for its model takes the slot of an in-flight ``flex`` request that has sent
nothing to its client yet.

Both are judged by the class they count as now, their ``rank``: a ``flex`` request that
waited past the aging bound was dispatched as ``default`` (:mod:`relay.core.classqueue`)
and keeps that rank while it runs, so it is never preempted, neither by a request that
arrived after it aged (which would pass it) nor by the one whose arrival freed its slot.

That request gets a ``cancel`` (reason ``preempted``; a worker that announced no
extension hears ``client_disconnect``, which it treats the same) and goes back to the
front of its class without spending its requeue budget: its client sees nothing but a
later start. Of the candidates, the one that started last is taken (the least work
thrown away). A request is preempted at most ``max_preemptions`` times, then keeps its
slot. Nothing is preempted for a request that would not get the freed slot (one of the
same model, at a worker that takes it).

:class:`Preemption` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from relay.core.classes import FLEX_RANK
from relay.core.config import RelayConfig
from relay.core.registry import Registry
from relay.core.state import RelayRequest, Worker
from relay.core.stats import RelayStats
from relay.wire.protocol import CancelReason

if TYPE_CHECKING:
    from relay.core.providers import ProviderState

logger = logging.getLogger("relay")


class Preemption:
    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        stats: RelayStats

        def _abandon(self, request: RelayRequest, reason: CancelReason) -> None: ...

        def _requeue(self, request: RelayRequest, *, spend: bool = True) -> bool: ...

        def _dispatch_provider(self, name: str) -> None: ...

    def _preempt_for(self, state: ProviderState, request: RelayRequest) -> bool:
        """``request`` (just queued, of a class above ``flex``) found no free slot: take
        one from a ``flex`` request if one may lose it. True when one was taken."""
        if request.rank >= FLEX_RANK:
            return False
        victim = self._victim(state, request)
        if victim is None:
            return False
        self._preempt(victim, request)
        return True

    def _victim(self, state: ProviderState, request: RelayRequest) -> RelayRequest | None:
        workers = [
            worker
            for worker in self.registry.serving_workers(state.policy.name, request.model)
            if not worker.draining and (worker.refuses is None or worker.refuses(request) is None)
        ]
        return self.preemptible(workers, request.model)

    def preemptible(self, workers: Iterable[Worker], model: str) -> RelayRequest | None:
        """The ``flex`` request on ``workers`` that should lose its slot to a request for
        ``model``, if one may: it still counts as ``flex`` (it was not aged into a higher
        class before it was dispatched), sent nothing to its client yet, preempted fewer
        than ``max_preemptions`` times, owned here; the one that started last."""
        best: RelayRequest | None = None
        limit = self.config.max_preemptions
        for worker in workers:
            for running in worker.in_flight.values():
                if (
                    running.rank >= FLEX_RANK
                    and running.model == model
                    and not running.delivered
                    and running.preemptions < limit
                    and running.relay_role != "worker"  # its own process requeues those
                    and (best is None or running.assigned_at > best.assigned_at)
                ):
                    best = running
        return best

    def _preempt(self, victim: RelayRequest, winner: RelayRequest | None = None) -> None:
        if winner is not None:
            winner.why = f"preemption of {victim.id} ({victim.service_class})"
        self.preempt(victim, f"{winner.id} ({winner.service_class})" if winner else "")

    def preempt(self, victim: RelayRequest, why: str = "") -> None:
        """Take ``victim``'s slot: cancel it at its worker, put it back at the front of
        its class (no requeue spent). The slot goes to the highest class waiting."""
        worker = victim.worker
        assert worker is not None
        victim.preemptions += 1
        self.stats.preemptions += 1
        logger.info(
            "preempted %s (flex, %d time(s)) on %s%s",
            victim.id,
            victim.preemptions,
            worker.name,
            f" for {why}" if why else "",
            extra={"request_id": victim.id},
        )
        # The freed slot goes to the highest class waiting (the winner, or an older one).
        self._abandon(victim, "preempted")
        if self._requeue(victim, spend=False):
            self._dispatch_provider(victim.provider)
