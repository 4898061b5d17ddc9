"""Per-key limits (SPEC §13): what an API key may do, and the admission that enforces it.

A key's :class:`KeyLimits` come from its database row through the key cache. When
keys are required, the HTTP edge calls :meth:`Limiter.admit` once per request, after
the body is parsed and before the dispatcher sees it. The checks run in this order;
the first that fails answers:

====================================  ======  ==========================================
check                                 status  ``Retry-After``
====================================  ======  ==========================================
the key expired                       401
the model is not in allowed_models    403
tokens this month ≥ tokens_per_month  429     until the 1st of next month, 00:00 UTC
tokens today ≥ tokens_per_day         429     until 00:00 UTC
over requests_per_minute              429     until the next request would pass
queued + running ≥ max_concurrent     429     1 s
====================================  ======  ==========================================

Budgets are checked on admission only, so a request that started under budget
finishes; its tokens (as its worker reported them) count when it ends. Meanwhile what
it may cost (:func:`reservation`: the output tokens it asks for at most, plus its
prompt) is *reserved*: admission counts the key's spend plus everything reserved by its
requests in flight, so a key cannot start more at once than its budget covers, and a
budget is overshot by at most what its last admitted requests really cost beyond it.
When a request ends its reservation is settled: replaced by its real tokens, or just
released when it failed or was cancelled (a dead process's reservations stop counting
with its lease, see :mod:`relay.server.cluster.limits`).
``requests_per_minute`` is a continuously refilled allowance (GCRA, the token bucket
as a single timestamp): a burst of up to N, then one more every 60/N seconds; it has
no window edges at which 2N requests could pass within a second.

The counters live in a :class:`LimitStore`: :class:`relay.core.limitstore.MemoryLimitStore`
in a single process, :class:`relay.server.cluster.limits.RedisLimitStore` (atomic Lua
scripts, one round trip per admission at most) when several processes share Redis.
A request admitted here carries a :class:`Ticket` until it ends (the dispatcher
closes it): its concurrency slot, its weight in the fair queue, its key.
"""

from __future__ import annotations

import calendar
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgspec

from relay.core.affinity import Prompt
from relay.wire.errors import (
    ConcurrencyLimited,
    DailyQuotaExceeded,
    KeyExpired,
    ModelNotAllowed,
    MonthlyQuotaExceeded,
    RateLimited,
    RequestRateLimited,
)
from relay.wire.protocol import TokenCounts

logger = logging.getLogger("relay.limits")

DAY = 86_400.0
#: At most one warning per this many seconds while the limit store is unreachable.
WARN_EVERY_SECS = 60.0
#: The most a fair-share weight may be (one key then takes this many turns per round).
MAX_WEIGHT = 1000


#: A prompt is reckoned at this many bytes of body a token (JSON and text average about
#: four): a reservation needs the right size, not the tokenizer's count.
BYTES_PER_TOKEN = 4
#: The most one request reserves (a client's absurd ``max_tokens`` stays a number).
MAX_RESERVATION = 1 << 30


def reservation(prompt_bytes: int, *max_output: object) -> int:
    """What a request may cost against its key's token budgets, reserved when it is
    admitted: the most output tokens it asks for (the largest positive integer of
    ``max_output``, e.g. ``max_completion_tokens``, ``max_tokens``, ``max_output_tokens``;
    none: 0) plus its prompt's ``prompt_bytes`` at :data:`BYTES_PER_TOKEN` a token,
    at most :data:`MAX_RESERVATION`."""
    most = 0
    for value in max_output:
        if type(value) is int and value > most:  # (not a bool, not a float)
            most = value
    return min(MAX_RESERVATION, most + -(-prompt_bytes // BYTES_PER_TOKEN))


class Cost(Prompt):
    """What a request may cost against its key's token budgets, as its body says: the
    output it asks for at most (chat's ``max_completion_tokens`` or ``max_tokens``,
    completions' and Anthropic's ``max_tokens``, Responses' ``max_output_tokens``) and
    its prompt's parts (kept raw). The HTTP edge decodes it with the model, in the same
    pass (:mod:`relay.server.http.request`)."""

    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None

    def reservation(self) -> int:
        """The tokens to reserve for it (:func:`reservation`)."""
        prompt = (
            len(self.system)
            + len(self.instructions)
            + len(self.tools)
            + len(self.messages)
            + len(self.input)
            + len(self.prompt)
        )
        return reservation(
            prompt, self.max_completion_tokens, self.max_tokens, self.max_output_tokens
        )


_cost_decoder = msgspec.json.Decoder(Cost)


def reservation_of(body: bytes | str) -> int:
    """The tokens to reserve for a body nothing decoded yet (a batch line's); 0 when it
    is not a JSON object."""
    try:
        return _cost_decoder.decode(body).reservation()
    except (msgspec.DecodeError, RecursionError):
        return 0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """An API key's limits; None means "no limit"."""

    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    #: The model names (as clients send them) the key may use; None: every model.
    allowed_models: frozenset[str] | None = None
    #: Unix time after which the key is refused (401).
    expires_at: float | None = None
    #: Share of the pool under contention, relative to other keys (default 1).
    weight: int = 1
    #: Priority classes (SPEC §15): what a request that asks for none gets, and the
    #: highest it may ask for.
    default_class: str = "default"
    max_class: str = "default"
    #: The first-token deadline (ms) of a request that states none (SPEC §21); None:
    #: its class's, if any.
    deadline_ms: int | None = None

    @property
    def budgeted(self) -> bool:
        """Whether the key has a token budget (and so its requests reserve tokens)."""
        return self.tokens_per_day is not None or self.tokens_per_month is not None

    @property
    def counted(self) -> bool:
        """Whether admission needs the store (anything beyond expiry and models)."""
        return (
            self.max_concurrent is not None
            or self.requests_per_minute is not None
            or self.tokens_per_day is not None
            or self.tokens_per_month is not None
        )


NO_LIMITS = KeyLimits()


class Periods(NamedTuple):
    """The UTC day and month a moment falls in, and when each ends (Unix time)."""

    day: int  # days since 1970-01-01
    month: int  # year * 12 + month - 1
    day_ends: float
    month_ends: float


class Calendar:
    """:func:`periods` with the answer for the current day remembered."""

    __slots__ = ("_current",)

    def __init__(self) -> None:
        self._current = periods(0.0)

    def at(self, now: float) -> Periods:
        current = self._current
        if not current.day_ends - DAY <= now < current.day_ends:
            current = self._current = periods(now)
        return current


def periods(now: float) -> Periods:
    day = math.floor(now / DAY)
    moment = time.gmtime(now)
    year, month = moment.tm_year, moment.tm_mon
    following = (year + 1, 1) if month == 12 else (year, month + 1)
    month_ends = float(calendar.timegm((*following, 1, 0, 0, 0, 0, 0, 0)))
    return Periods(day, year * 12 + month - 1, (day + 1) * DAY, month_ends)


class Limit(enum.Enum):
    MONTH = "tokens_per_month"
    DAY = "tokens_per_day"
    RATE = "requests_per_minute"
    CONCURRENCY = "max_concurrent"


class Refusal(NamedTuple):
    """Which counted limit refused a request; ``retry_after`` (seconds) when the store
    knows it (the request rate), else 0 and the limiter works it out."""

    limit: Limit
    retry_after: float = 0.0


class LimitStoreUnavailable(Exception):
    """The store could not be reached; the limiter admits without the counted limits."""


class LimitStore(Protocol):
    """Where the counters of the counted limits live. Called on the event loop."""

    async def acquire(
        self, key_id: int, limits: KeyLimits, at: Periods, now: float, reserve: int = 0
    ) -> Refusal | None:
        """Check ``limits`` (budgets, rate, concurrency, in :data:`Limit` order; a budget
        counts the tokens spent and those reserved by requests in flight) and, when none
        is exceeded, count the request — a concurrency slot when ``max_concurrent`` is
        set, one request in the rate when ``requests_per_minute`` is, ``reserve`` tokens
        reserved when the key has a budget — all atomically, in one round trip at most.
        Raises :class:`LimitStoreUnavailable` when the store cannot answer."""

    def finish(self, key_id: int, held: bool, tokens: int, at: Periods, reserved: int = 0) -> None:
        """A request of ``key_id`` ended: give back its slot when it ``held`` one, release
        the ``reserved`` tokens and add ``tokens`` to the key's spend for the day and
        month ``at``, at once. Returns at once."""

    async def spend(self, key_ids: Collection[int], at: Periods) -> dict[int, tuple[int, int]]:
        """Tokens spent (today, this month) per key that spent any."""


def tokens_of(counts: TokenCounts | None) -> int:
    """What a request costs against token budgets: its total as the backend reported it."""
    if counts is None:
        return 0
    if counts.total_tokens is not None:
        return counts.total_tokens
    return (counts.prompt_tokens or 0) + (counts.completion_tokens or 0)


class Ticket:
    """One admitted request of one key; :meth:`close` exactly once when it ends."""

    __slots__ = ("_limiter", "held", "key_id", "open", "reserved", "weight")

    def __init__(
        self, limiter: Limiter, key_id: int, weight: int, held: bool, reserved: int = 0
    ) -> None:
        self._limiter = limiter
        self.key_id = key_id
        self.weight = weight
        #: True when the store counted a concurrency slot for it.
        self.held = held
        #: Tokens the store reserved for it against the key's budgets.
        self.reserved = reserved
        self.open = True

    def close(self, counts: TokenCounts | None = None) -> None:
        """The request ended (or was never queued): free its slot, settle its
        reservation with the tokens it cost. Idempotent."""
        if self.open:
            self.open = False
            self._limiter.finished(self, tokens_of(counts))


class Limiter:
    def __init__(self, store: LimitStore, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self.calendar = Calendar()
        #: Admitted requests not ended yet (queued or running here), per key.
        self.open: Counter[int] = Counter()
        #: Requests admitted without the counted limits because the store was down.
        self.store_failures = 0
        #: The last :meth:`spend` answer (for scrapes, which cannot wait on the store).
        self.last_spend: dict[int, tuple[int, int]] = {}
        self._warned_at = -WARN_EVERY_SECS

    def _warn(self, message: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_SECS:
            self._warned_at = now
            logger.warning("%s: %s (%d failure(s) so far)", message, exc, self.store_failures)

    def check_expiry(self, key_id: int, limits: KeyLimits) -> None:
        expires = limits.expires_at
        if expires is not None and self.clock() >= expires:
            shown = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
            raise KeyExpired(f"API key expired at {shown}")

    async def admit(self, key_id: int, limits: KeyLimits, model: str, tokens: int = 0) -> Ticket:
        """Admit one request of ``key_id`` for ``model`` that may cost ``tokens``
        (:func:`reservation`), or raise the error that says which limit refused it (see
        the module docstring)."""
        self.check_expiry(key_id, limits)
        allowed = limits.allowed_models
        if allowed is not None and model not in allowed:
            raise ModelNotAllowed(model)
        held = False
        reserved = 0
        if limits.counted:
            now = self.clock()
            at = self.calendar.at(now)
            try:
                refusal = await self.store.acquire(key_id, limits, at, now, tokens)
            except LimitStoreUnavailable as exc:
                self.store_failures += 1
                self._warn("limit store unavailable, admitting without the counted limits", exc)
                refusal = None
            else:
                held = refusal is None and limits.max_concurrent is not None
                if refusal is None and limits.budgeted:
                    reserved = tokens
            if refusal is not None:
                raise self.refused(refusal, limits, at, now)
        self.open[key_id] += 1
        return Ticket(self, key_id, limits.weight, held, reserved)

    def finished(self, ticket: Ticket, tokens: int) -> None:
        key_id = ticket.key_id
        left = self.open[key_id] - 1
        if left > 0:
            self.open[key_id] = left
        else:
            self.open.pop(key_id, None)
        if ticket.held or tokens or ticket.reserved:
            at = self.calendar.at(self.clock())
            self.store.finish(key_id, ticket.held, tokens, at, ticket.reserved)

    def charge(self, key_id: int, tokens: int) -> None:
        """Count ``tokens`` against a key's budgets without a ticket: a request another
        server process admitted (and holds the slot of) ran on a worker here, so only
        this process learned its tokens (cluster mode)."""
        if tokens:
            self.store.finish(key_id, False, tokens, self.calendar.at(self.clock()))

    async def spend(self, key_ids: Collection[int]) -> dict[int, tuple[int, int]]:
        """Tokens spent today and this month per key (cluster-wide with Redis)."""
        try:
            self.last_spend = await self.store.spend(key_ids, self.calendar.at(self.clock()))
        except LimitStoreUnavailable as exc:
            self._warn("limit store unavailable, showing the last known spend", exc)
        return self.last_spend

    @staticmethod
    def refused(refusal: Refusal, limits: KeyLimits, at: Periods, now: float) -> RateLimited:
        match refusal.limit:
            case Limit.MONTH:
                return MonthlyQuotaExceeded(
                    f"Monthly token budget of this API key ({limits.tokens_per_month}) is "
                    "spent; it renews on the 1st at 00:00 UTC",
                    retry_after=math.ceil(at.month_ends - now),
                )
            case Limit.DAY:
                return DailyQuotaExceeded(
                    f"Daily token budget of this API key ({limits.tokens_per_day}) is spent; "
                    "it renews at 00:00 UTC",
                    retry_after=math.ceil(at.day_ends - now),
                )
            case Limit.RATE:
                wait = max(1, math.ceil(refusal.retry_after))
                return RequestRateLimited(
                    f"Rate limit of this API key ({limits.requests_per_minute} requests per "
                    f"minute) reached; retry in {wait} s",
                    retry_after=wait,
                )
            case _:
                return ConcurrencyLimited(
                    f"Too many concurrent requests for this API key (limit "
                    f"{limits.max_concurrent}, queued or running)",
                    retry_after=1,
                )
