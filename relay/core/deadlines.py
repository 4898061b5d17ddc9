"""Deadlines for the first token (SPEC §21): refuse at once what no worker can meet.

An agent step, a voice turn or an autocomplete is worth nothing late. A request may say
how long it can wait for its first token (``X-Deadline-Ms``, :func:`parse`), or get its
API key's default, else its priority class's (:func:`resolve`). The relay then:

- **at admission** predicts its time to first token (:mod:`relay.core.prediction`): on
  the worker it would go to now, or, when every worker is busy, after the wait for a
  slot. If even that is more than the deadline allows, the request is refused at once
  with 503, ``Retry-After`` and the predicted wait (:class:`DeadlineUnmeetable`), rather
  than waiting in a queue it cannot get out of in time. The prediction checked is its
  p90 (the prediction times the spread of that worker's past predictions), so that
  what is admitted meets its deadline;
- **while it waits** it leaves the queue with the same answer at the last moment it
  could still start and make it (its deadline less the fastest worker's predicted
  time to first token), rather than be served late;
- **once it runs** nothing more is done: whether it met its deadline is counted
  (``met`` / ``missed``).

A request with a deadline is routed by prediction whatever ROUTING_POLICY says (it
asked for a time, not for a cache hit). The deadline is about the first token: for a
request that is not streamed, the first byte its client sees is its last.

:class:`Deadlines` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import TYPE_CHECKING, Final

from relay.core.state import RelayRequest, Worker
from relay.wire.errors import BadRequest, DeadlineUnmeetable

if TYPE_CHECKING:
    from relay.core.placement import Placement
    from relay.core.prediction import Predictor
    from relay.core.providers import ProviderState
    from relay.core.registry import Registry

#: The header a client states its deadline in, and the longest deadline it may state.
HEADER: Final = b"x-deadline-ms"
MAX_DEADLINE_MS: Final = 3_600_000
#: What is counted (``/admin/stats``, ``/metrics``): requests refused at admission,
#: requests that left the queue at their last moment, and of those that got a first
#: byte, those that got it in time and those that did not.
RESULTS: Final = ("refused", "expired", "met", "missed")


def parse(value: bytes | None) -> int | None:
    """The deadline an ``X-Deadline-Ms`` header value states (None: no header), or
    :class:`BadRequest` saying what is wrong: a whole number of milliseconds from 1 to
    :data:`MAX_DEADLINE_MS`, in ASCII digits."""
    if value is None:
        return None
    text = value.strip(b" \t")
    # bytes.isdigit() is ASCII only: no sign, no spaces inside, no other numerals.
    if not text or len(text) > len(str(MAX_DEADLINE_MS)) or not text.isdigit():
        raise BadRequest(
            f"X-Deadline-Ms must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS}"
        )
    ms = int(text)
    if not 1 <= ms <= MAX_DEADLINE_MS:
        raise BadRequest(
            f"X-Deadline-Ms must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS}"
        )
    return ms


def resolve(stated: int | None, key_default: int | None, class_default: int | None) -> int | None:
    """A request's deadline (ms): what it stated, else its key's, else its class's."""
    for ms in (stated, key_default, class_default):
        if ms:
            return ms
    return None


class Deadlines:
    if TYPE_CHECKING:  # provided by the dispatcher
        loop: asyncio.AbstractEventLoop
        registry: Registry
        predictor: Predictor
        placement: Placement | None

        @property
        def clustered(self) -> bool: ...

    def _init_deadlines(self) -> None:
        self.deadlines: Counter[str] = Counter()

    def _check_now(self, request: RelayRequest, worker: Worker, now: float) -> None:
        """``request`` is about to go to ``worker``, a free one: refuse it if even there
        its first token is predicted to come too late."""
        predicted = self.predictor.ttft(worker, request, now)
        likely = self.predictor.likely(worker, request.model, predicted)
        if now + likely > request.first_token_by:
            self.deadlines["refused"] += 1
            raise DeadlineUnmeetable(request.deadline_ms, predicted)

    def _check_queued(self, state: ProviderState, request: RelayRequest, now: float) -> None:
        """``request`` found no free worker: refuse it if its first token is predicted to
        come too late after the wait for a slot; otherwise note the last moment it may
        still start (its queue deadline, see :meth:`_start_by`)."""
        predicted = self._predicted_wait(state, request, now)
        best = self._best_worker(request, now)
        likely = self.predictor.likely(best, request.model, predicted)
        if not math.isfinite(predicted) or now + likely > request.first_token_by:
            self.deadlines["refused"] += 1
            raise DeadlineUnmeetable(
                request.deadline_ms, predicted if math.isfinite(predicted) else None
            )

    def _check_cluster(self, state: ProviderState, request: RelayRequest, now: float) -> None:
        """Cluster mode: the best of this process's free workers and of the other
        processes' (their shared speeds and loads), else the wait for a slot."""
        eligible = self.registry.eligible(state.policy.name, request.model, request)
        worker, predicted = self.predictor.best(request, eligible, now)
        assert self.placement is not None
        elsewhere = self.placement.predict(request)
        if elsewhere is not None and elsewhere < predicted:
            worker, predicted = None, elsewhere
        if not math.isfinite(predicted):
            predicted = self._predicted_wait(state, request, now)
        likely = self.predictor.likely(worker, request.model, predicted)
        if not math.isfinite(predicted) or now + likely > request.first_token_by:
            self.deadlines["refused"] += 1
            raise DeadlineUnmeetable(
                request.deadline_ms, predicted if math.isfinite(predicted) else None
            )

    def _predicted_wait(self, state: ProviderState, request: RelayRequest, now: float) -> float:
        """``request``'s predicted time to first token from ``now`` while it waits."""
        provider = state.policy.name
        workers = self.registry.loaded_workers(provider, request.model)
        ahead = sum(len(q) for q in state.queue.classes[: request.rank + 1])
        predicted = self.predictor.queued(request, workers, ahead, now)
        if self.placement is not None:
            elsewhere = self.placement.predict(request)
            if elsewhere is not None and elsewhere < predicted:
                predicted = elsewhere
        return predicted

    def _best_worker(self, request: RelayRequest, now: float) -> Worker | None:
        workers = self.registry.loaded_workers(request.provider, request.model)
        return self.predictor.best(request, workers, now)[0]

    def _start_by(self, request: RelayRequest, now: float) -> float:
        """The last moment ``request`` may leave the queue and still be predicted to meet
        its deadline: its deadline less the fastest worker's time to first token when
        idle (0 when no worker serves its model here)."""
        workers = self.registry.loaded_workers(request.provider, request.model)
        if not workers:
            return request.first_token_by
        fastest = min(self.predictor.ttft(w, request, now, idle=True) for w in workers)
        return request.first_token_by - fastest

    def _deadline_error(
        self, request: RelayRequest, state: ProviderState | None
    ) -> DeadlineUnmeetable:
        """The answer of a request that waited until it could no longer meet its
        deadline: the same as at admission, with the wait predicted now."""
        self.deadlines["expired"] += 1
        now = self.loop.time()
        predicted = None
        if state is not None:
            wait = self._predicted_wait(state, request, now)
            if math.isfinite(wait):
                predicted = (now - request.created) + wait
        return DeadlineUnmeetable(request.deadline_ms, predicted)

    def _first_token(self, request: RelayRequest, now: float) -> None:
        """A request with a deadline got its first byte at ``now``."""
        if now <= request.first_token_by:
            self.deadlines["met"] += 1
        else:
            self.deadlines["missed"] += 1
