"""API keys as the hot path sees them: an in-memory table checked without the ORM.

The table maps a key's lookup prefix to its id, HMAC, name and limits (SPEC §13); the
Django edge reloads it
whenever keys change (at once in this process, within a second elsewhere). Usage is
counted here and flushed to the database in the background, never per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from relay.core.credentials import PREFIX_LEN, verify_secret
from relay.core.limits import NO_LIMITS, KeyLimits
from relay.core.stats import RequestRecord
from relay.wire.errors import Flavor, Unauthorized

#: How every relay API key begins (``mrk_…``); such a value is never forwarded.
KEY_KIND = "mrk_"


@dataclass(frozen=True, slots=True)
class KnownKey:
    id: int
    key_hash: str
    name: str = ""
    limits: KeyLimits = NO_LIMITS


@dataclass(slots=True)
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_used: float = 0.0


class KeyCache:
    def __init__(self, pepper: str) -> None:
        self._pepper = pepper
        self._keys: dict[str, KnownKey] = {}
        self._by_id: dict[int, KnownKey] = {}
        self.usage: dict[int, Usage] = {}
        self.loaded = False

    def replace(self, keys: dict[str, KnownKey]) -> None:
        """Swap in a freshly loaded table of active keys (prefix -> key)."""
        self._keys = keys
        self._by_id = {key.id: key for key in keys.values()}
        self.loaded = True

    def get(self, key_id: int) -> KnownKey | None:
        """The active key with id ``key_id`` (its name and limits), or None."""
        return self._by_id.get(key_id)

    def active(self) -> list[KnownKey]:
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._keys)

    def verify(self, token: str) -> int | None:
        """The id of the active key ``token`` is, or None."""
        known = self._keys.get(token[:PREFIX_LEN])
        if known is None or not verify_secret(token, self._pepper, known.key_hash):
            return None
        return known.id

    def authenticate(
        self, headers: list[tuple[bytes, bytes]], flavor: Flavor
    ) -> tuple[int, frozenset[str]]:
        """Find and check the client's key in ``Authorization: Bearer`` (or ``x-api-key``
        on the Anthropic route).

        Returns the key id and every header that carries a relay key (one that
        verifies, or that merely looks like one): none of them may reach a backend,
        whichever of them authenticated the request.
        """
        bearer: str | None = None
        api_key: str | None = None
        other_scheme = ignored_api_key = False
        carriers: set[str] = set()
        for name, value in headers:
            token = ""
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = bearer = rest.strip()
                else:
                    token = value.decode("latin-1").strip()
                    other_scheme = True
            elif name == b"x-api-key":
                token = value.decode("latin-1").strip()
                if flavor == "anthropic":
                    api_key = token
                else:
                    ignored_api_key = bool(token)
            else:
                continue
            if token.startswith(KEY_KIND) or (token and self.verify(token) is not None):
                carriers.add(name.decode())
        for given in (bearer, api_key):
            if given:
                key_id = self.verify(given)
                if key_id is not None:
                    return key_id, frozenset(carriers)
        raise Unauthorized(_unauthorized(flavor, bearer, api_key, other_scheme, ignored_api_key))

    def observe(self, record: RequestRecord) -> None:
        """Request observer: count usage per key for the background flush (in cluster
        mode, where the worker is: that process knows the tokens)."""
        if record.key_id is None or record.relay_role == "origin":
            return
        usage = self.usage.get(record.key_id)
        if usage is None:
            usage = self.usage[record.key_id] = Usage()
        usage.requests += 1
        usage.prompt_tokens += record.prompt_tokens or 0
        usage.completion_tokens += record.completion_tokens or 0
        usage.last_used = time.time()

    def take_usage(self) -> dict[int, Usage]:
        usage, self.usage = self.usage, {}
        return usage

    def restore_usage(self, usage: dict[int, Usage]) -> None:
        """Put back usage that could not be written, merged with what came since."""
        for key_id, old in usage.items():
            current = self.usage.setdefault(key_id, Usage())
            current.requests += old.requests
            current.prompt_tokens += old.prompt_tokens
            current.completion_tokens += old.completion_tokens
            current.last_used = max(current.last_used, old.last_used)


def _unauthorized(
    flavor: Flavor,
    bearer: str | None,
    api_key: str | None,
    other_scheme: bool,
    ignored_api_key: bool,
) -> str:
    """What the 401 says: what was sent, and what the route accepts."""
    accepted = (
        "x-api-key: <key> or Authorization: Bearer <key>"
        if flavor == "anthropic"
        else "Authorization: Bearer <key>"
    )
    if bearer or api_key:
        sent = " and ".join(
            name
            for name, given in (("Authorization: Bearer", bearer), ("x-api-key", api_key))
            if given
        )
        return f"Invalid or revoked API key (sent in {sent})"
    if ignored_api_key:
        return f"x-api-key is accepted on /v1/messages only; this route takes {accepted}"
    if other_scheme:
        return f"Authorization must use the Bearer scheme: send {accepted}"
    return f"Missing API key: send {accepted}"
