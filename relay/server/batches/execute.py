"""One batch line run as a request of its key: admitted, submitted, awaited, judged.

The line goes through the same doors as a client request: the key's admission
(limits, budgets, fair-share weight; SPEC §13) and ``relay.submit`` with service
class ``flex`` (SPEC §15), never streaming. What comes back decides the line:
an answer is its result (2xx-3xx succeeded, the rest errored); a failure of the worker
or backend is tried again up to MAX_REQUEUE_COUNT times; a refusal for the moment
waits and is tried again without counting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from batches.models import ANTHROPIC, CANCELED, ERRORED, SUCCEEDED
from relay.core.keycache import KeyCache
from relay.core.limits import KeyLimits, Ticket, reservation_of
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, RelayRequest
from relay.server.batches.claims import Claimed, Result
from relay.wire.errors import (
    ClientError,
    Flavor,
    NotFound,
    ProviderDisabled,
    QueueFull,
    QueueTimeout,
    RateLimited,
    RelayError,
    ShuttingDown,
    Unauthorized,
)

#: Statuses a backend or worker answers when it failed, not the request: tried again.
RETRIED_STATUSES = frozenset({502, 503, 504})
#: What the worker's backend gets besides the body.
HEADERS = {
    "openai": {"content-type": "application/json"},
    ANTHROPIC: {"content-type": "application/json", "anthropic-version": "2023-06-01"},
}


class SharedQueue(Protocol):
    """Cluster mode: the shared queue, as last seen."""

    queue_depth: int


class Host(Protocol):
    """What the engine uses of the runtime that owns it."""

    loop: asyncio.AbstractEventLoop
    relay: Relay
    keys: KeyCache
    require_keys: bool

    @property
    def placement(self) -> SharedQueue | None: ...

    def key_limits(self, key_id: int) -> KeyLimits: ...

    async def admit(
        self, key_id: int, model: str, cost: Callable[[], int] | None = None
    ) -> Ticket: ...

    async def ready(self) -> None: ...


@dataclass(eq=False, slots=True)
class Running:
    """A line being run here: its admission, then its request in the core."""

    line: Claimed
    task: asyncio.Task[None] | None = None
    request: RelayRequest | None = None
    #: Set when the engine stops it (its batch was cancelled or ran out of time).
    ended: str = ""


@dataclass(frozen=True, slots=True)
class Retry:
    """Try the line again after ``delay`` seconds; ``spend``: it counts as a failure;
    ``pause_key``: the key is over a limit, none of its lines runs before then."""

    delay: float
    spend: bool
    pause_key: bool = False


async def execute(
    rt: Host, run: Running, flavor: Flavor | None, *, retry_delay: float
) -> Result | Retry:
    """Run one line to its end here: a result, or when to try it again."""
    line = run.line
    relay = rt.relay
    limit = relay.config.max_requeue_count
    if flavor is None:
        return errored(line, NotFound(f"{line.endpoint} is not relayed here any more"))
    ticket = None
    if line.key_id is not None and rt.require_keys:
        if not rt.keys.loaded:
            return Retry(retry_delay, spend=False)  # the keys are not read yet
        if rt.keys.get(line.key_id) is None:
            return errored(line, Unauthorized("The batch's API key was revoked"))
        try:
            ticket = await rt.admit(line.key_id, line.model, partial(reservation_of, line.body))
        except RelayError as err:
            return judge_error(line, err, limit, retry_delay)
    if run.ended:  # its batch ended while it was being admitted
        if ticket is not None:
            ticket.close()
        return ended(line, run.ended)
    try:
        request = relay.submit(
            model=line.model,
            endpoint_path=line.endpoint,
            flavor=flavor,
            is_streaming=False,
            body=line.body,
            headers=dict(HEADERS.get(line.api, HEADERS["openai"])),
            key_id=line.key_id,
            ticket=ticket,
            service_class="flex",
        )
    except RelayError as err:
        if ticket is not None:
            ticket.close()
        return judge_error(line, err, limit, retry_delay)
    run.request = request
    try:
        while True:
            for event in await request.next_events():
                if isinstance(event, Completion):
                    return judge_answer(line, event, request, limit)
                if isinstance(event, RelayError):
                    return judge_error(line, event, limit, retry_delay)
                if event is CANCELLED:
                    return ended(line, run.ended or CANCELED)
    finally:
        relay.cancel(request, "client_disconnect")  # no-op once it ended
        relay.release(request)


def judge_answer(
    line: Claimed, answer: Completion, request: RelayRequest, limit: int
) -> Result | Retry:
    """An answer is the line's result, unless it says the worker or backend failed
    and the line may be tried again (``limit``: MAX_REQUEUE_COUNT)."""
    failed = answer.status in RETRIED_STATUSES
    if failed and line.failures < limit:
        return Retry(0.0, spend=True)
    counts = request.token_counts
    return Result(
        line.line_id,
        line.token,
        line.batch_id,
        line.failures + (1 if failed else 0),
        outcome=SUCCEEDED if answer.status < 400 else ERRORED,
        status_code=answer.status,
        response=answer.body.decode(errors="replace"),
        request_id=request.id,
        prompt_tokens=counts.prompt_tokens if counts else None,
        completion_tokens=counts.completion_tokens if counts else None,
        cached_tokens=counts.cached_tokens if counts else None,
    )


def judge_error(line: Claimed, err: RelayError, limit: int, retry_delay: float) -> Result | Retry:
    """A failure: not now (tried again later at no cost), never (the line's result),
    or the worker's (tried again while ``limit`` allows)."""
    delay = max(retry_delay, float(err.retry_after or 0))
    if isinstance(err, RateLimited):
        return Retry(delay, spend=False, pause_key=True)  # the key's limits: not now
    if isinstance(err, QueueFull | QueueTimeout | ShuttingDown | ProviderDisabled):
        return Retry(delay, spend=False)  # no room, or no worker in time: later
    if isinstance(err, ClientError):
        return errored(line, err)  # trying again would be refused the same way
    if line.failures < limit:
        return Retry(0.0, spend=True)
    return errored(line, err, failures=line.failures + 1)


def errored(line: Claimed, err: RelayError, *, failures: int | None = None) -> Result:
    return Result(
        line.line_id,
        line.token,
        line.batch_id,
        line.failures if failures is None else failures,
        outcome=ERRORED,
        error_code=err.code,
        error_message=err.message,
    )


def ended(line: Claimed, outcome: str) -> Result:
    return Result(line.line_id, line.token, line.batch_id, line.failures, outcome)
