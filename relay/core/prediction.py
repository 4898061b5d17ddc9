"""Predicted time to first token (SPEC §21): where a request would start answering first.

For a worker ``w`` that can take request ``r`` now::

    ttft(w, r) = overhead(w) + wait(w) + uncached(w, r) * seconds_per_token(w)

- ``overhead`` and ``seconds_per_token`` are ``w``'s learned speed on ``r``'s model
  (:mod:`relay.core.rates`; the fleet's while it has none);
- ``uncached`` is ``r``'s prompt tokens (its prompt's bytes over the model's bytes per
  token) less those cache-aware routing predicts ``w``'s backend holds (the prefix of
  ``r`` its index says it sent there, :meth:`relay.core.affinity.Router.depth`);
- ``wait`` is the prefill work already sent to ``w`` and not done yet: each worker keeps
  the moment its backend is predicted to be through the prompts it was given
  (:attr:`Worker.busy_until`). A request sent there pushes it on by its own prefill; its
  first byte re-anchors it (whatever came after it is still ahead, from now); a request
  that leaves before its first byte takes back what it had not used. A backend that runs
  several prompts at once shares its prefill throughput among them, which is what one
  moment per worker models, in O(1) per request.

Under ``ROUTING_POLICY=predicted`` (and for every request with a deadline, whatever the
policy) the dispatcher sends a request to the worker with the lowest prediction among
those the bounded-load guard of cache-aware routing allows (:meth:`Predictor.choose`),
ties to the less loaded. The prediction of the worker it went to is kept on the request
and checked against what it measured (the spread of the two is what a request's p95 is
predicted from, for hedging and deadlines).

When every worker is busy, the wait for a slot is predicted from the pool's rate of
freeing them: each worker frees ``max_concurrent / service time`` slots a second
(:meth:`Predictor.queued`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from relay.core.rates import REFIT_SECS, Rates

if TYPE_CHECKING:
    from relay.core.affinity import Prompt, Router
    from relay.core.state import RelayRequest, Worker


def prompt_bytes(prompt: Prompt | None, body: str) -> int:
    """The bytes of a request's prompt: its prompt fields as the edge decoded them
    (system or instructions, tools, then messages, input or prompt; no copy), else the
    whole body."""
    if prompt is not None:
        size = (
            len(prompt.system)
            + len(prompt.instructions)
            + len(prompt.tools)
            + len(prompt.messages or prompt.input or prompt.prompt)
        )
        if size:
            return size
    return len(body)


class Predictor:
    """Predictions for the dispatcher; one per relay, sharing its rates and router."""

    __slots__ = ("rates", "router")

    def __init__(self, rates: Rates, router: Router) -> None:
        self.rates = rates
        self.router = router

    def _fit(self, worker: Worker, model: str, now: float) -> tuple[float, float]:
        """``(seconds per prompt token, overhead)`` of ``worker`` on ``model``."""
        speed = worker.speed.get(model)
        if speed is None:
            prior = self.rates.prior(model, now)
            return prior.secs_per_token, prior.overhead
        if now - speed.fitted > REFIT_SECS:
            speed.fit(now, self.rates.prior(model, now), self.rates.config)
        return speed.secs_per_token, speed.overhead

    def _cached(self, worker: Worker, request: RelayRequest, per_token: float) -> float:
        """Prompt tokens ``worker``'s backend is predicted to hold of ``request``'s."""
        affinity = request.affinity
        if affinity is None or not affinity.blocks:
            return 0.0
        depth = self.router.depth(worker.id, affinity.blocks)
        if not depth:
            return 0.0
        return affinity.covered(depth, self.router.config.block_bytes) * per_token

    def ttft(
        self, worker: Worker, request: RelayRequest, now: float, *, idle: bool = False
    ) -> float:
        """``request``'s predicted time to first token on ``worker`` (seconds); ``idle``:
        were nothing ahead of it there."""
        per_byte = 1.0 / self.rates.bytes_per_token(request.model)
        tokens = request.prompt_bytes * per_byte
        spt, overhead = self._fit(worker, request.model, now)
        own = tokens - self._cached(worker, request, per_byte)
        wait = 0.0 if idle else worker.busy_until - now
        return overhead + (wait if wait > 0.0 else 0.0) + (own if own > 0.0 else 0.0) * spt

    def choose(
        self, request: RelayRequest, workers: Sequence[Worker], now: float, model: str
    ) -> Worker | None:
        """The worker of ``workers`` (all can take ``request`` now, as ``model``: the
        backend's name for it, an alias resolved) predicted to answer first, among those
        the bounded-load guard allows; None when there is none."""
        if not workers:
            return None
        if len(workers) == 1:
            return workers[0]
        bound = self.router.bound(workers)
        per_byte = 1.0 / self.rates.bytes_per_token(model)
        tokens = request.prompt_bytes * per_byte
        blocks = request.affinity.blocks if request.affinity is not None else None
        best: Worker | None = None
        best_ttft = math.inf
        for worker in workers:
            load = worker.load
            if load + 1 > bound:
                continue
            spt, overhead = self._fit(worker, model, now)
            own = tokens
            if blocks:
                own -= self._cached(worker, request, per_byte)
            wait = worker.busy_until - now
            ttft = overhead + (wait if wait > 0.0 else 0.0) + (own if own > 0.0 else 0.0) * spt
            if ttft < best_ttft or (ttft == best_ttft and best is not None and load < best.load):
                best, best_ttft = worker, ttft
        return best if best is not None else workers[0]

    def best(
        self, request: RelayRequest, workers: Sequence[Worker], now: float
    ) -> tuple[Worker | None, float]:
        """The worker of ``workers`` with the lowest prediction for ``request`` (no
        guard), and that prediction (``inf`` for none)."""
        best: Worker | None = None
        best_ttft = math.inf
        for worker in workers:
            ttft = self.ttft(worker, request, now)
            if ttft < best_ttft:
                best, best_ttft = worker, ttft
        return best, best_ttft

    def queued(
        self, request: RelayRequest, workers: Sequence[Worker], ahead: int, now: float
    ) -> float:
        """``request``'s predicted time to first token when every one of ``workers`` (those
        that serve its model) is busy and ``ahead`` requests wait before it: the time the
        pool takes to free ``ahead + 1`` slots, then its best prediction."""
        rate = 0.0
        for worker in workers:
            if worker.draining:
                continue
            service = self._service(worker, request.model, now)
            rate += worker.max_concurrent / service
        if rate <= 0.0:
            return math.inf
        slot = (ahead + 1) / rate
        _, ttft = self.best(request, [w for w in workers if not w.draining], now + slot)
        return slot + ttft

    def _service(self, worker: Worker, model: str, now: float) -> float:
        speed = worker.speed.get(model)
        if speed is None:
            return self.rates.prior(model, now).service
        if now - speed.fitted > REFIT_SECS:
            speed.fit(now, self.rates.prior(model, now), self.rates.config)
        return speed.service

    # -- what happened ------------------------------------------------------------------

    def attempt(
        self, request: RelayRequest, worker: Worker, now: float
    ) -> tuple[float, float, float, float, float]:
        """``request`` is being sent to ``worker`` (before cache-aware routing records
        that the worker now holds its prefix): push the worker's prefill on by the
        request's own. Returns the prediction, when its prefill is predicted to end and
        how long it takes, the prompt tokens predicted cached there, and the prefill
        predicted ahead of it there (seconds)."""
        per_byte = 1.0 / self.rates.bytes_per_token(request.model)
        spt, overhead = self._fit(worker, request.model, now)
        cached = self._cached(worker, request, per_byte)
        own = request.prompt_bytes * per_byte - cached
        if own < 0.0:
            own = 0.0
        wait = worker.busy_until - now
        if wait < 0.0:
            wait = 0.0
        prefill = own * spt
        end = worker.busy_until = now + wait + prefill
        return overhead + wait + prefill, end, prefill, cached, wait

    def assigned(self, request: RelayRequest, worker: Worker, now: float) -> None:
        """``request`` is being sent to ``worker``: :meth:`attempt`, kept on the request."""
        (
            request.predicted,
            request.prefill_end,
            request.prefill_secs,
            request.cached_guess,
            request.ahead,
        ) = self.attempt(request, worker, now)

    def started(self, request: RelayRequest, worker: Worker, now: float) -> None:
        """``request``'s first byte came from ``worker``: its prompt is done, and what was
        sent there after it is still ahead of the next, counted from now."""
        end = request.prefill_end
        if end <= 0.0:
            return
        request.prefill_end = 0.0
        after = worker.busy_until - end
        if after < 0.0:
            after = 0.0
        worker.busy_until = now + after

    def dropped(self, request: RelayRequest, worker: Worker, now: float) -> None:
        """``request`` left ``worker`` without a first byte (cancelled, handed back, lost,
        or answered whole): the part of its prefill not yet due is taken back."""
        end = request.prefill_end
        if end <= 0.0:
            return
        request.prefill_end = 0.0
        self.release(worker, end, request.prefill_secs, now)

    @staticmethod
    def release(worker: Worker, end: float, secs: float, now: float) -> None:
        """Take back from ``worker`` the part not yet due of a prefill of ``secs`` that
        was to end at ``end``."""
        start = end - secs
        unused = end - (start if start > now else now)
        if unused > 0.0:
            worker.busy_until -= unused

    def p95(self, request: RelayRequest, worker: Worker) -> float:
        """The predicted p95 of ``request``'s time to first token on ``worker`` (seconds
        from its dispatch): its prediction times the spread of that worker's predictions."""
        speed = worker.speed.get(request.model)
        spread = speed.spread95 if speed is not None else 2.0
        return request.predicted * spread

    def likely(self, worker: Worker | None, model: str, predicted: float) -> float:
        """A prediction as a deadline is checked against it: its p90 on ``worker``."""
        speed = worker.speed.get(model) if worker is not None else None
        return predicted * (speed.spread90 if speed is not None else 1.0)
