"""The batch engine's limits and timings, read from settings (README, "Settings")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from django.conf import settings

from relay.core.routes import parse_routes
from relay.wire.errors import Flavor


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """Every limit and timing of the engine (README, "Settings")."""

    max_in_flight: int = 64
    #: Free slots per model a batch leaves for everyone else (BATCH_SPARE_SLOTS).
    spare: int = 0
    poll: float = 1.0
    claim: float = 60.0
    flush: float = 0.25
    window: float = 86_400.0
    max_lines: int = 50_000
    max_queued: int = 100_000
    retention_days: int = 30

    @classmethod
    def from_settings(cls) -> BatchSettings:
        s = settings
        return cls(
            max_in_flight=s.BATCH_MAX_IN_FLIGHT,
            spare=s.BATCH_SPARE_SLOTS,
            poll=s.BATCH_POLL_SECS,
            # Claims are renewed at polls, three times per claim at least.
            claim=max(s.BATCH_CLAIM_SECS, 3 * s.BATCH_POLL_SECS),
            flush=s.BATCH_FLUSH_SECS,
            window=s.BATCH_COMPLETION_WINDOW_SECS,
            max_lines=s.BATCH_MAX_LINES,
            max_queued=s.BATCH_MAX_QUEUED_LINES_PER_KEY,
            retention_days=s.BATCH_RETENTION_DAYS,
        )


def flavor(endpoint: str) -> Flavor | None:
    """How the relay treats ``endpoint`` now (None: it is no longer relayed)."""
    return _routes(tuple(settings.RELAY_ROUTES)).get(endpoint)


@functools.cache
def _routes(spec: tuple[str, ...]) -> dict[str, Flavor]:
    return parse_routes(list(spec))
