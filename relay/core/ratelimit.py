"""Failed worker authentication, throttled per client address, with expiry.

After ``max_failures`` failures within ``window`` seconds an address is blocked for
``block`` seconds; entries expire on their own so the table cannot grow without
bound. The client address is the TCP peer unless the peer is a configured trusted
proxy, in which case the right-most untrusted ``X-Forwarded-For`` hop is used.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True)
class _Entry:
    failures: int
    window_start: float
    blocked_until: float = 0.0


class AuthThrottle:
    def __init__(
        self,
        *,
        max_failures: int = 5,
        window: float = 60.0,
        block: float = 300.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window = window
        self.block = block
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def blocked(self, address: str) -> float:
        """Seconds until ``address`` may try again (0 when it may now)."""
        entry = self._entries.get(address)
        if entry is None:
            return 0.0
        now = self._clock()
        if entry.blocked_until > now:
            return entry.blocked_until - now
        if now - entry.window_start > self.window:
            del self._entries[address]
        return 0.0

    def failure(self, address: str) -> None:
        now = self._clock()
        entry = self._entries.get(address)
        if entry is None or now - entry.window_start > self.window:
            if len(self._entries) >= self.max_entries:
                self._expire(now)
            self._entries[address] = _Entry(failures=1, window_start=now)
            entry = self._entries[address]
        else:
            entry.failures += 1
        if entry.failures >= self.max_failures:
            entry.blocked_until = now + self.block

    def success(self, address: str) -> None:
        self._entries.pop(address, None)

    def _expire(self, now: float) -> None:
        horizon = max(self.window, self.block)
        for address in [
            a
            for a, e in self._entries.items()
            if e.blocked_until <= now and now - e.window_start > horizon
        ]:
            del self._entries[address]
        if len(self._entries) >= self.max_entries:
            # Still full of live entries: forget the oldest half rather than grow.
            oldest = sorted(self._entries.items(), key=lambda item: item[1].window_start)
            for address, _ in oldest[: len(oldest) // 2]:
                del self._entries[address]

    def __len__(self) -> int:
        return len(self._entries)


def parse_networks(values: Iterable[str]) -> list[Network]:
    return [ipaddress.ip_network(v, strict=False) for v in values]


def client_address(peer: str, forwarded_for: str | None, trusted: list[Network]) -> str:
    """The address to attribute a connection to (see module docstring)."""
    if not trusted or not forwarded_for or not _within(peer, trusted):
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        if not _within(hop, trusted):
            return hop
    return hops[0] if hops else peer


def _within(address: str, networks: list[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)
