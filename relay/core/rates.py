"""Learned speeds (SPEC §21): how fast each worker prefills and decodes each model.

Boxes differ: a 4090 and a 3060 serve the same model at very different speeds, and a box
whose GPU is shared slows down when its owner plays a game. For each (worker, model) the
relay keeps a :class:`~relay.core.speed.Speed`, fed by every request that worker finished
(:meth:`Rates.observe`), from what the relay sees anyway:

- time to first byte (measured from the request's dispatch, for streams), less the
  prefill predicted to be ahead of it on that worker when it was sent there
  (:mod:`relay.core.prediction`), against the prompt tokens the backend had to process:
  those it reported (``prompt_tokens`` less ``cached_tokens``, the closed loop of
  cache-aware routing). A weighted least-squares line through them (a sample weighing
  the less, the more was waiting ahead of it) gives the worker's fixed overhead (its
  intercept) and its seconds per prompt token (its slope). The wait ahead is taken out
  rather than counted as tokens: a rate estimated wrong then shows in the overhead,
  and fades as the rate comes right, where counting the wait in tokens of a wrong rate
  would feed the error back into the rate;
- llama-server's ``timings`` when the backend reports them (``prefill_ms``,
  ``decode_ms`` in ``token_counts``): the backend's own prefill time for a request that
  had nothing ahead of it pins the slope down;
- completion tokens over the time from first byte to the end (or ``decode_ms``): the
  decode rate; and each request's whole time on the worker: its service time.

Every sum decays with a half-life (RATES_HALF_LIFE_SECS), so a box that slows down is
noticed within about one half-life, and what was learned about a box that stopped
getting requests fades back to the fleet's view of it. That view is each model's
*fleet median* over the workers that serve it, which a worker with no history borrows
outright and every worker's own estimate is pulled towards, with the weight of
``prior_weight`` requests: its *confidence* is ``n / (n + prior_weight)``, ``n`` the
decayed count of its own samples. A model no worker has served yet gets the config's
defaults.

The relay has no tokenizer: a prompt's token count is its bytes (the prompt fields of
the body, :class:`relay.core.affinity.Prompt`) over the model's bytes per token, learned
the same way from the prompt tokens backends report.

Everything here is bounded: speeds live on their worker (:attr:`Worker.speed`) and go
with it; the per-model table holds the workers that serve a model and at most
:data:`MAX_MODELS` models' bytes per token. Like the rest of the core it runs on the
event loop; reading a speed costs a few attribute lookups (its fit is redone at most
every :data:`REFIT_SECS`), so predictions stay cheap enough to make for every request.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from relay.core.speed import Fit, Speed, SpeedConfig

if TYPE_CHECKING:
    from relay.wire.protocol import TokenCounts


class Worker(Protocol):
    """What learning reads of a worker (:class:`relay.core.state.Worker`)."""

    @property
    def id(self) -> str: ...
    @property
    def speed(self) -> dict[str, Speed]: ...


class RelayRequest(Protocol):
    """What learning reads of a finished request (:class:`relay.core.state.RelayRequest`):
    what it was, and what was predicted and measured where it ran."""

    @property
    def model(self) -> str: ...
    @property
    def is_streaming(self) -> bool: ...
    @property
    def prompt_bytes(self) -> int: ...
    @property
    def assigned_at(self) -> float: ...
    @property
    def first_byte_at(self) -> float | None: ...
    @property
    def predicted(self) -> float: ...
    @property
    def ahead(self) -> float: ...
    @property
    def cached_guess(self) -> float: ...
    @property
    def prefill_secs(self) -> float: ...


#: A speed's fit is redone from its sums at most this often (and after each sample).
REFIT_SECS = 1.0
#: Models whose bytes per token are remembered (least recently learned dropped).
MAX_MODELS = 4096
#: A time to first byte over this many times its prediction counts as that much in what
#: is learned, unless more than ISOLATED came in a row (see :meth:`Rates.observe`).
OUTLIER = 3.0
ISOLATED = 2


class _Model:
    """One model across the fleet: who serves it, its median speed, its bytes per token."""

    __slots__ = ("median", "median_at", "members")

    def __init__(self, default: Fit) -> None:
        #: worker id -> its speed (workers connected here, and in cluster mode the
        #: speeds the other processes share).
        self.members: dict[str, Speed] = {}
        self.median = default
        self.median_at = -math.inf


class Rates:
    """Every speed the relay knows; one per relay (see the module docstring)."""

    def __init__(self, config: SpeedConfig) -> None:
        self.config = config
        self.default = Fit(1.0 / config.prefill, config.overhead, config.decode, config.service)
        self._models: dict[str, _Model] = {}
        #: Cluster mode: worker id -> model -> what another process shared of it.
        self._remote: dict[str, dict[str, Speed]] = {}
        #: model -> decayed (prompt bytes, prompt tokens, when), least recently learned first.
        self._bytes: OrderedDict[str, list[float]] = OrderedDict()

    # -- reading ------------------------------------------------------------------------

    def prior(self, model: str, now: float) -> Fit:
        """The fleet median of ``model``'s speeds (the defaults while none is known)."""
        entry = self._models.get(model)
        if entry is None:
            return self.default
        if now - entry.median_at > REFIT_SECS:
            entry.median_at = now
            entry.median = self._median(entry)
        return entry.median

    def _median(self, entry: _Model) -> Fit:
        """The median of the members' own lines (of those with a sample's worth of
        recent history, else of all that ever had one)."""
        known = [s.own for s in entry.members.values() if s.samples > 0 and s.n >= 1.0]
        if not known:
            known = [s.own for s in entry.members.values() if s.samples > 0]
        if not known:
            return self.default
        middle = len(known) // 2

        def median(values: list[float]) -> float:
            values.sort()
            if len(values) % 2:
                return values[middle]
            return (values[middle - 1] + values[middle]) / 2

        return Fit(
            median([f.secs_per_token for f in known]),
            median([f.overhead for f in known]),
            median([f.decode for f in known]),
            median([f.service for f in known]),
        )

    def fit(self, worker: Worker, model: str, now: float) -> Fit:
        """``worker``'s speed on ``model`` now (the fleet's while it has none)."""
        speed = worker.speed.get(model)
        if speed is None:
            return self.prior(model, now)
        if now - speed.fitted > REFIT_SECS:
            speed.fit(now, self.prior(model, now), self.config)
        return Fit(speed.secs_per_token, speed.overhead, speed.decode, speed.service)

    def speed(self, worker: Worker, model: str, now: float) -> Speed:
        """``worker``'s :class:`Speed` on ``model``, made (from the fleet's) if new."""
        speed = worker.speed.get(model)
        if speed is None:
            speed = worker.speed[model] = Speed(now, self.prior(model, now))
            entry = self._models.get(model)
            if entry is None:
                entry = self._models[model] = _Model(self.default)
            entry.members[worker.id] = speed
        return speed

    def bytes_per_token(self, model: str) -> float:
        learned = self._bytes.get(model)
        if learned is None or learned[1] < 1.0:
            return self.config.bytes_per_token
        return learned[0] / learned[1]

    def tokens(self, model: str, prompt_bytes: int) -> float:
        """The prompt tokens ``prompt_bytes`` of a prompt for ``model`` make, estimated."""
        return prompt_bytes / self.bytes_per_token(model)

    # -- learning -----------------------------------------------------------------------

    def observe(
        self,
        request: RelayRequest,
        worker: Worker,
        counts: TokenCounts | None,
        now: float,
        status: int,
    ) -> None:
        """``worker`` finished ``request`` (``now``, with ``status``): learn from it.

        Only what a backend that answered tells: an error status teaches nothing of
        speeds. The time to first byte counts for streams (a whole answer's first byte
        is its last) unless the backend reported its own prefill time."""
        if status >= 400 or request.assigned_at <= 0.0:
            return
        config = self.config
        speed = self.speed(worker, request.model, now)
        speed.decay(now, config.half_life)
        speed.samples += 1
        speed.served(now - request.assigned_at, request.prefill_secs)
        prompt = counts.prompt_tokens if counts is not None else None
        cached = counts.cached_tokens if counts is not None else None
        if prompt is not None and counts is not None and not counts.estimated:
            self._learn_bytes(request.model, request.prompt_bytes, prompt, now)
        if prompt is None:
            prompt_seen = self.tokens(request.model, request.prompt_bytes)
            processed = max(0.0, prompt_seen - request.cached_guess)
        else:
            processed = float(max(0, prompt - (cached or 0)))
        first = request.first_byte_at
        prefill_ms = counts.prefill_ms if counts is not None else None
        if request.is_streaming and first is not None and first >= request.assigned_at:
            ttfb = first - request.assigned_at
            # A stall now and then (the box busy with something else for seconds) is
            # not its speed: once the worker is known, a sample over OUTLIER times its
            # prediction counts as that much, unless the ones before it were over too
            # (then the box did slow down, and is learned as it is now).
            learned = ttfb
            if request.predicted > 0.0 and speed.confidence >= 0.5:
                if ttfb > OUTLIER * request.predicted:
                    speed.outliers += 1
                    if speed.outliers <= ISOLATED:
                        learned = OUTLIER * request.predicted
                else:
                    speed.outliers = 0
            # What the prefill predicted ahead of it took is not its own: its line is
            # fitted to the rest, a sample counting the less the more of it was waiting
            # (a wait predicted too long or short then shows in the overhead, and fades
            # as the rate it was predicted with comes right: no loop feeds on itself).
            own = learned - request.ahead
            if own > 0.0:
                weight = 1.0
                if request.ahead > 0.0 and request.prefill_secs > 0.0:
                    weight = request.prefill_secs / (request.prefill_secs + request.ahead)
                speed.first_byte(processed, own, weight)
            if request.predicted > 0.0:
                speed.checked(request.predicted, ttfb)
            completion = counts.completion_tokens if counts is not None else None
            decode_ms = counts.decode_ms if counts is not None else None
            if decode_ms and completion:
                speed.decoded(completion, decode_ms / 1000)
            elif completion and completion > 1 and now > first:
                speed.decoded(completion - 1, now - first)
        elif counts is not None and counts.decode_ms and counts.completion_tokens:
            speed.decoded(counts.completion_tokens, counts.decode_ms / 1000)
        if prefill_ms is not None and processed > 0 and request.ahead <= 0.0:
            speed.prefill_timing(processed, prefill_ms / 1000)
        speed.fit(now, self.prior(request.model, now), config)
        if speed.samples == 1:  # a new member of the fleet's median, its line made now
            self._models[request.model].median_at = -math.inf

    def _learn_bytes(self, model: str, prompt_bytes: int, tokens: int, now: float) -> None:
        if prompt_bytes <= 0 or tokens <= 0:
            return
        learned = self._bytes.get(model)
        if learned is None:
            learned = self._bytes[model] = [0.0, 0.0, now]
            while len(self._bytes) > MAX_MODELS:
                self._bytes.popitem(last=False)
        else:
            self._bytes.move_to_end(model)
            f = 0.5 ** (max(0.0, now - learned[2]) / self.config.half_life)
            learned[0] *= f
            learned[1] *= f
            learned[2] = now
        learned[0] += prompt_bytes
        learned[1] += tokens

    # -- membership ---------------------------------------------------------------------

    def forget(self, worker: Worker) -> None:
        """``worker`` left: its speeds leave the fleet's median (they go with it)."""
        for model in worker.speed:
            entry = self._models.get(model)
            if entry is None:
                continue
            entry.members.pop(worker.id, None)
            entry.median_at = -math.inf
            if not entry.members:
                del self._models[model]

    def share(self, remote: dict[str, dict[str, Speed]]) -> None:
        """Cluster mode: the speeds the other processes learned of their workers (worker
        id -> model -> speed), all of them, replacing the last: they count in each
        model's fleet median like the local ones."""
        for worker_id, models in self._remote.items():
            for model in models:
                entry = self._models.get(model)
                if entry is not None and remote.get(worker_id, {}).get(model) is None:
                    entry.members.pop(worker_id, None)
                    entry.median_at = -math.inf
                    if not entry.members:
                        del self._models[model]
        for worker_id, models in remote.items():
            for model, speed in models.items():
                entry = self._models.get(model)
                if entry is None:
                    entry = self._models[model] = _Model(self.default)
                entry.members[worker_id] = speed
                entry.median_at = -math.inf
        self._remote = remote

    def models(self) -> list[str]:
        return sorted(self._models)
