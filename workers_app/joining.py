"""Join tokens and joined workers (SPEC §22): minted, listed and revoked by operators.

Shared by the Django admin, the setup wizard, the admin JSON API and ``manage.py``. A
token is shown once (only its lookup prefix and HMAC are kept), expires, lets ``uses``
workers join one provider; the worker trades it at ``POST /v1/worker/join``
(:mod:`relay.server.identities`) for a credential of its own. Revoking a joined worker
closes its connection on whichever server process holds it — at once through the
provider-change broadcast, else at that process's next sync — and refuses it from then
on; every other worker stays.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from relay.core.credentials import generate_secret, hash_secret, lookup_prefix
from workers_app.models import JoinedWorker, JoinToken, Provider

#: The longest a join token may stay usable, and the most workers one may let join.
MAX_TTL_SECS = 30 * 86400.0
MIN_TTL_SECS = 1.0
MAX_USES = 1000
#: Expired, spent or revoked tokens are deleted this long after they stopped being
#: usable (when the next token is minted): the table stays bounded.
KEEP_SPENT_DAYS = 30

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """``90s``, ``30m``, ``1h``, ``7d`` or plain seconds; raises ValueError outside
    the allowed range."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1h, 7d)")
    return check_ttl(float(match.group(1)) * _UNIT[match.group(2)])


def check_ttl(seconds: float) -> float:
    if not MIN_TTL_SECS <= seconds <= MAX_TTL_SECS:
        raise ValueError(f"a join token lives from 1 second to {MAX_TTL_SECS / 86400:g} days")
    return seconds


def check_uses(uses: int) -> int:
    if not 1 <= uses <= MAX_USES:
        raise ValueError(f"a join token lets from 1 to {MAX_USES} workers join")
    return uses


@dataclass(frozen=True)
class NewToken:
    token: JoinToken
    #: In clear: show it once, never store it.
    secret: str


def mint_token(
    provider: Provider, *, ttl_secs: float | None = None, uses: int = 1, created_by: str = ""
) -> NewToken:
    """A new join token for ``provider``; raises ValueError for a TTL or use count out
    of range."""
    ttl = check_ttl(settings.JOIN_TOKEN_TTL_SECS if ttl_secs is None else ttl_secs)
    check_uses(uses)
    now = timezone.now()
    prune_tokens(now)
    for _ in range(5):  # lookup prefixes are random; retry the rare collision
        secret = generate_secret("mrj")
        token = JoinToken(
            provider=provider,
            prefix=lookup_prefix(secret),
            token_hash=hash_secret(secret, settings.SECRET_PEPPER),
            uses=uses,
            expires_at=now + dt.timedelta(seconds=ttl),
            created_by=created_by[:100],
        )
        try:
            with transaction.atomic():
                token.save()
        except IntegrityError:
            continue
        return NewToken(token, secret)
    raise RuntimeError("could not allocate a unique join token prefix")


def prune_tokens(now: dt.datetime | None = None) -> int:
    """Delete tokens that stopped being usable more than KEEP_SPENT_DAYS ago."""
    cutoff = (now or timezone.now()) - dt.timedelta(days=KEEP_SPENT_DAYS)
    deleted, _ = JoinToken.objects.filter(expires_at__lt=cutoff).delete()
    return deleted


def revoke_token(token: JoinToken) -> bool:
    """No worker may join with ``token`` any more; False when it already could not."""
    if token.revoked_at is not None:
        return False
    token.revoked_at = timezone.now()
    token.save(update_fields=["revoked_at"])
    return True


def revoke_worker(worker: JoinedWorker) -> bool:
    """Revoke ``worker``'s credential: its connection closes on whichever process holds
    it, and it is refused from then on. False when it already was revoked."""
    from relay.server import control

    with transaction.atomic():
        revoked = JoinedWorker.objects.filter(pk=worker.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        # Every process re-reads at once; without the broadcast, at its next sync tick.
        transaction.on_commit(control.providers_changed)
    worker.refresh_from_db()
    return revoked == 1


def find_worker(ref: str) -> JoinedWorker:
    """A joined worker by id, or by name when exactly one has it; raises LookupError."""
    if ref.isdigit():
        found = JoinedWorker.objects.select_related("provider").filter(pk=int(ref)).first()
        if found is not None:
            return found
    named = list(JoinedWorker.objects.select_related("provider").filter(name=ref)[:10])
    if len(named) == 1:
        return named[0]
    if named:
        ids = ", ".join(str(w.pk) for w in named)
        raise LookupError(f"{len(named)} joined workers are named '{ref}'; use an id: {ids}")
    raise LookupError(f"no joined worker with id or name '{ref}'")


def joined_workers(provider: str | None = None) -> QuerySet[JoinedWorker]:
    rows = JoinedWorker.objects.select_related("provider").order_by("provider__name", "name")
    return rows if provider is None else rows.filter(provider__name=provider)


def describe(worker: JoinedWorker, now: dt.datetime | None = None) -> dict[str, object]:
    """One joined worker as the admin API and ``manage.py`` show it."""
    now = now or timezone.now()
    return {
        "id": worker.pk,
        "name": worker.name,
        "provider": worker.provider.name,
        "prefix": worker.prefix,
        "created_at": worker.created_at,
        "last_seen_at": worker.last_seen_at,
        "last_address": worker.last_address,
        "connected": worker.connected(now),
        "revoked_at": worker.revoked_at,
    }


def release_holds() -> int:
    """Let go of every joined worker's hold (``serve`` at start without Redis: no other
    process holds any, and those of a process that was killed are stale)."""
    return JoinedWorker.objects.exclude(holder="").update(holder="", held_until=None)
