"""Hedged requests (SPEC §21): a ``priority`` stream that has no first byte by its
predicted p95 is sent a second time, to the next-best worker; the first to answer wins.

A tail latency of a shared box (a GPU its owner games on, a backend swapping, a stall
now and then) hurts a ``priority`` request most; sending it twice for the few that
stall removes most of that tail for a few percent more backend requests ("The Tail at
Scale"). Off by default (HEDGE_MAX_SHARE=0).

**One request, two attempts.** The client's :class:`~relay.core.state.RelayRequest`
stays the one object its edge reads from, holds one key ticket and ends in one record:
it is counted and charged once, whatever happens. Its first attempt is its
``worker``; a hedge is a second attempt on another worker under the same request id,
held in :attr:`RelayRequest.hedge` (:class:`Hedge`) and in that worker's ``in_flight``
(so it takes one of its slots). Until one of them sends something, every frame of
either is first seen by :meth:`Hedging._race`, which settles it: the attempt whose frame
it is (a chunk, a completion) becomes the request's ``worker`` and the other gets a
``cancel`` and its slot back (the normal cancel path: its late frames are strays and
dropped), so not a byte of the loser ever reaches the client. An attempt that fails or
is lost (an error frame, its worker gone) while the other runs leaves the other as the
only one, and nothing is requeued. A client that leaves, a timeout, any end: both
attempts are cancelled.

**When.** Only ``priority`` streams (a whole answer's first byte is its last), never in
cluster mode (a second attempt would need a second shared reservation: the cluster's
capacity is counted there), at most ``max_share`` of the ``priority`` requests (a
credit per request, a hedge costs one, at most two saved up) and only while the pool has
room: a free slot on a worker other than the first, and nothing waiting for the
provider. Its time is the first attempt's predicted p95 (its prediction times the spread
of that worker's, :mod:`relay.core.prediction`), never less than ``min_delay``. A
request the share or a full pool kept from its hedge is looked at again once it has
waited as long again; while the share is short (under two hedges' credit saved up) the
last hedge goes only to a request silent twice its p95: the share goes to the requests
that stay silent longest (a stall), not to those just past their p95.

A request that is not hedged pays one attribute test per frame (``hedge is None``) and,
when hedging is on, one timer per ``priority`` stream.

:class:`Hedging` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Final

from relay.core.classes import PRIORITY
from relay.core.state import ARMED, RACING, SETTLED, Hedge, Phase, RelayRequest, Worker
from relay.wire import protocol

if TYPE_CHECKING:
    from relay.core.config import RelayConfig
    from relay.core.prediction import Predictor
    from relay.core.providers import ProviderState
    from relay.core.registry import Registry
    from relay.core.stats import RelayStats
    from relay.core.tracer import RequestTracer

logger = logging.getLogger("relay")

#: The most credit the share saves up (two hedges), and how long past its predicted p95
#: a request must have stayed silent to take the last hedge's credit (see :meth:`_hedge`).
BURST: Final = 2.0
SILENT: Final = 2.0
#: What is counted (``/admin/stats``, ``/metrics``): hedges sent, won by the second
#: attempt, lost to the first, ended by a failure of one attempt; and timers that fired
#: without a hedge, for the share or for a saturated pool.
RESULTS: Final = ("sent", "won", "lost", "failed", "over_share", "saturated")


class Hedging:
    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        predictor: Predictor
        stats: RelayStats
        tracer: RequestTracer

        @property
        def clustered(self) -> bool: ...

        def _freed(
            self, worker: Worker, lease: str | None = None, *, light: bool = False
        ) -> None: ...

    def _init_hedging(self) -> None:
        #: Hedges the share allows now (each ``priority`` stream adds ``max_share``).
        self.hedge_credit = 0.0
        self.hedges: Counter[str] = Counter()

    # -- arming -------------------------------------------------------------------------

    def _arm_hedge(self, request: RelayRequest, worker: Worker, now: float) -> None:
        """``request`` was just sent to ``worker``: if it may be hedged, time its hedge."""
        config = self.config.hedging
        if (
            request.service_class != PRIORITY
            or not request.is_streaming
            or request.light
            or worker.remote
            or request.relay_role
            or self.clustered
        ):
            return
        hedge = request.hedge
        if hedge is None:
            hedge = request.hedge = Hedge()
            self.hedge_credit = min(self.hedge_credit + config.max_share, BURST)
        elif hedge.state != ARMED:
            return  # sent to a new worker after its hedge: not hedged twice
        if hedge.timer is not None:
            hedge.timer.cancel()
        hedge.due = max(config.min_delay, self.predictor.p95(request, worker))
        hedge.timer = self.loop.call_at(now + hedge.due, self._hedge, request)

    def _hedge(self, request: RelayRequest) -> None:
        """The hedge timer fired: send the second attempt if it is still wanted."""
        hedge = request.hedge
        if hedge is None:
            return
        hedge.timer = None
        primary = request.worker
        if (
            hedge.state != ARMED
            or request.phase is not Phase.ASSIGNED
            or request.delivered
            or primary is None
        ):
            return
        now = self.loop.time()
        # Past its p95 a request may be hedged; while the share is short (one hedge's
        # credit left, not two), only one silent SILENT times that long takes it: the
        # last credit is kept for a stall rather than spent on a request just past its
        # p95, which mostly answers meanwhile.
        silent = now - request.assigned_at >= SILENT * hedge.due
        if self.hedge_credit < (1.0 if silent else BURST):
            self.hedges["over_share"] += 1
            self._defer_hedge(request, hedge, now)
            return
        state = self.providers.get(request.provider)
        eligible = [
            w
            for w in self.registry.eligible(request.provider, request.model, request)
            if w is not primary
        ]
        if state is None or len(state.queue) or not eligible or self.clustered:
            self.hedges["saturated"] += 1
            self._defer_hedge(request, hedge, now)
            return
        target, _ = self.predictor.best(request, eligible, now)
        assert target is not None
        self.hedge_credit -= 1.0
        hedge.state = RACING
        hedge.worker = target
        hedge.sent_at = now
        hedge.predicted, hedge.end, hedge.secs, hedge.cached, hedge.ahead = self.predictor.attempt(
            request, target, now
        )
        target.in_flight[request.id] = request
        self.hedges["sent"] += 1
        logger.info(
            "hedged %s: no first byte from %s after %.0f ms; also sent to %s",
            request.id,
            primary.name,
            1000 * (now - request.assigned_at),
            target.name,
            extra={"request_id": request.id},
        )
        target.link.send(
            protocol.Request(
                request_id=request.id,
                model=request.model,
                endpoint_path=request.endpoint_path,
                is_streaming=request.is_streaming,
                body=request.body,
                headers=self.tracer.hedged(request, target, now),
            )
        )

    def _defer_hedge(self, request: RelayRequest, hedge: Hedge, now: float) -> None:
        """No hedge now (the share is spent, or the pool full): look again once it has
        waited as long again. What the share allows goes to the requests that stay
        without a first byte longest (a stall), not to those just past their p95, which
        mostly answer in the meantime."""
        waited = max(self.config.hedging.min_delay, now - request.assigned_at)
        hedge.timer = self.loop.call_at(now + waited, self._hedge, request)

    # -- settling -----------------------------------------------------------------------

    def _race(self, request: RelayRequest, worker: Worker) -> None:
        """The first frame of ``request`` came from ``worker`` (either attempt): it wins,
        the other is cancelled. Called before the frame is taken."""
        hedge = request.hedge
        assert hedge is not None
        if hedge.state == ARMED:
            hedge.state = SETTLED
            if hedge.timer is not None:
                hedge.timer.cancel()
                hedge.timer = None
            return
        if hedge.state != RACING:
            return
        hedge.state = SETTLED
        if worker is hedge.worker:
            self.hedges["won"] += 1
            loser = request.worker
            if loser is not None:
                end, secs = request.prefill_end, request.prefill_secs
                self._promote(request)
                self._drop_attempt(request.id, loser, None, end, secs)
            else:
                self._promote(request)
        else:
            self.hedges["lost"] += 1
            second = hedge.worker
            hedge.worker = None
            if second is not None:
                self._drop_attempt(request.id, second, None, hedge.end, hedge.secs)

    def _attempt_failed(self, request: RelayRequest, worker: Worker) -> bool:
        """One attempt of a racing request failed or was lost on ``worker`` (already out
        of its ``in_flight``): the other carries on alone. False when the request is not
        racing (the caller handles it as usual)."""
        hedge = request.hedge
        if hedge is None or hedge.state != RACING:
            return False
        hedge.state = SETTLED
        self.hedges["failed"] += 1
        now = self.loop.time()
        if worker is hedge.worker:
            hedge.worker = None
            self.predictor.release(worker, hedge.end, hedge.secs, now)
        else:
            self.predictor.dropped(request, worker, now)
            self._promote(request)
        logger.info(
            "%s: its attempt on %s ended; the other goes on",
            request.id,
            worker.name,
            extra={"request_id": request.id},
        )
        return True

    def _abandon_hedge(self, request: RelayRequest, reason: protocol.CancelReason) -> None:
        """``request`` is being taken from its worker (cancelled, timed out, cut off): its
        hedge goes too."""
        hedge = request.hedge
        assert hedge is not None
        if hedge.timer is not None:
            hedge.timer.cancel()
            hedge.timer = None
        second = hedge.worker
        hedge.worker = None
        if hedge.state == RACING and second is not None:
            self._drop_attempt(request.id, second, reason, hedge.end, hedge.secs)
        hedge.state = SETTLED

    def _promote(self, request: RelayRequest) -> None:
        """The second attempt becomes the request's only one."""
        hedge = request.hedge
        assert hedge is not None and hedge.worker is not None
        worker = hedge.worker
        hedge.worker = None
        request.worker = worker
        request.worker_id = worker.id
        request.worker_name = worker.name
        request.assigned_at = hedge.sent_at
        request.predicted = hedge.predicted
        request.prefill_end = hedge.end
        request.prefill_secs = hedge.secs
        request.cached_guess = hedge.cached
        request.ahead = hedge.ahead

    def _drop_attempt(
        self,
        request_id: str,
        worker: Worker,
        reason: protocol.CancelReason | None,
        end: float,
        secs: float,
    ) -> None:
        """Cancel the attempt of ``request_id`` on ``worker`` (its prefill was to end at
        ``end``, ``secs`` long) and free its slot: the request goes on elsewhere (no
        ``reason``: it lost a race), or ends (``reason``)."""
        if worker.take(request_id) is None:
            return
        self.predictor.release(worker, end, secs, self.loop.time())
        if not worker.attached:
            return
        sent = reason or "client_disconnect"  # lost a race: stop, nothing is wanted
        if (
            sent not in protocol.BASE_CANCEL_REASONS
            and protocol.FLOW_CONTROL not in worker.features
        ):
            sent = "client_disconnect"  # the nearest reason every worker knows
        worker.link.send(protocol.Cancel(request_id=request_id, reason=sent))
        self.stats.cancels[reason or "hedge_lost"] += 1
        self._freed(worker)
