"""Workers with a credential of their own (SPEC §22): joining, checking in, revoking.

A worker joins with a join token (``POST /v1/worker/join``, :mod:`relay.server.http.join`):
:func:`redeem` spends one use of the token and creates a
:class:`~workers_app.models.JoinedWorker` whose credential is shown this once; only a
lookup prefix and ``HMAC-SHA256(pepper, credential)`` are kept (STYLE 10).

It then connects with that credential. :meth:`Identities.check_in` (the worker
consumer, at the handshake) verifies it and takes the identity's **hold** in the
database: one connection at a time, across every server process, so a connection
presenting the identity of a worker that is connected now is refused (no takeover).
A hold lasts ``WORKER_LEASE_SECS`` unless renewed; the process holding it renews it
(and the worker's "last seen") a few times per lease, and lets it go when the socket
closes, so a process that died releases its workers' identities by itself.

Revoking (the admin, ``POST /admin/joined-workers/{id}/revoke``, ``manage.py
revoke_worker``) marks the row and makes every process re-read at once (the same
broadcast as a provider change). Each process also compares, at every sync tick
(``SYNC_SECS``), the identities it holds with the database, and closes those that
were revoked, deleted or taken over after its hold lapsed: a lost broadcast delays a
revocation by one tick, never more (:meth:`Identities.reconcile`).

Every database call here is synchronous and runs in a worker thread (``in_thread``).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from dataclasses import dataclass
from typing import Protocol

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from relay.core.credentials import generate_secret, hash_secret, lookup_prefix, verify_secret
from relay.server.bookkeeper import in_thread
from relay.wire.joining import CREDENTIAL_KIND, TOKEN_KIND
from workers_app.models import JoinedWorker, JoinToken, Provider

logger = logging.getLogger("relay.identities")

#: The close reasons a worker with its own credential may see.
REVOKED = "worker credential revoked"
INVALID = "invalid worker credential"
HELD = "connected already"
TAKEN = "connected again elsewhere"


class JoinError(Exception):
    """A join refused. ``counts``: a failure for the address's throttle (a bad,
    spent, expired or revoked token), as opposed to a disabled provider."""

    def __init__(self, reason: str, *, counts: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.counts = counts


class Refused(Exception):
    """A connection refused at check-in (closed with 1008 and ``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Joined:
    worker_id: int
    name: str
    provider: str
    credential: str


@dataclass(frozen=True)
class Hold:
    """A connection's hold on one identity."""

    identity: int
    name: str
    provider: Provider
    #: Unique per connection: the holder column names it.
    token: str


class Holder(Protocol):
    """What holds an identity: the worker consumer, closed on revocation."""

    def close_for(self, reason: str) -> None: ...


def redeem(token: str, name: str, address: str, pepper: str) -> Joined:
    """Spend one use of ``token`` and create the worker's identity (in a thread).

    Raises :class:`JoinError` saying why the token cannot be used. Two workers racing
    for the last use: exactly one joins (a conditional update spends the use).
    """
    if not token.startswith(TOKEN_KIND + "_"):
        raise JoinError("invalid join token")
    with transaction.atomic():
        row = JoinToken.objects.select_related("provider").filter(prefix=lookup_prefix(token))
        found = row.first()
        if found is None or not verify_secret(token, pepper, found.token_hash):
            raise JoinError("invalid join token")
        now = timezone.now()
        state = found.state(now)
        if state != "usable":
            raise JoinError(
                {
                    "used": "join token already used",
                    "expired": "join token expired",
                    "revoked": "join token revoked",
                }[state]
            )
        if not found.provider.enabled:
            raise JoinError(f"provider '{found.provider.name}' is disabled", counts=False)
        spent = JoinToken.objects.filter(
            pk=found.pk, used__lt=F("uses"), expires_at__gt=now, revoked_at__isnull=True
        ).update(used=F("used") + 1)
        if spent != 1:
            raise JoinError("join token already used")
        for _ in range(5):  # lookup prefixes are random; retry the rare collision
            credential = generate_secret(CREDENTIAL_KIND)
            try:
                with transaction.atomic():
                    worker = JoinedWorker.objects.create(
                        provider=found.provider,
                        name=name[:200],
                        prefix=lookup_prefix(credential),
                        credential_hash=hash_secret(credential, pepper),
                        joined_with=found,
                        last_address=address[:64],
                    )
            except IntegrityError:
                continue
            return Joined(worker.pk, worker.name, found.provider.name, credential)
    raise RuntimeError("could not allocate a unique credential prefix")


def _claim(
    credential: str, wanted: str | None, pepper: str, token: str, lease: float, address: str
) -> Hold:
    """Verify ``credential`` and take its identity's hold for ``token`` (in a thread)."""
    prefix = lookup_prefix(credential)
    row = JoinedWorker.objects.select_related("provider").filter(prefix=prefix).first()
    if row is None or not verify_secret(credential, pepper, row.credential_hash):
        raise Refused(INVALID)
    if row.revoked_at is not None:
        raise Refused(REVOKED)
    if wanted is not None and wanted != row.provider.name:
        raise Refused(f"this worker belongs to provider '{row.provider.name}'")
    now = timezone.now()
    free = Q(held_until__isnull=True) | Q(held_until__lte=now)
    taken = JoinedWorker.objects.filter(free, pk=row.pk, revoked_at__isnull=True).update(
        holder=token,
        held_until=now + dt.timedelta(seconds=lease),
        last_seen_at=now,
        last_address=address[:64],
    )
    if taken != 1:
        raise Refused(f"worker '{row.name}' (#{row.pk}) is {HELD}")
    return Hold(row.pk, row.name, row.provider, token)


def _still_held(hold: Hold) -> str | None:
    """Why ``hold`` no longer stands (revoked, deleted, taken), or None."""
    row = JoinedWorker.objects.filter(pk=hold.identity).values_list("revoked_at", "holder").first()
    if row is None or row[0] is not None:
        return REVOKED
    if row[1] != hold.token:
        return TAKEN
    return None


def _release(token: str) -> None:
    JoinedWorker.objects.filter(holder=token).update(
        holder="", held_until=None, last_seen_at=timezone.now()
    )


def _states(ids: list[int]) -> dict[int, tuple[bool, str]]:
    rows = JoinedWorker.objects.filter(pk__in=ids).values_list("pk", "revoked_at", "holder")
    return {pk: (revoked is not None, holder) for pk, revoked, holder in rows}


def _renew(tokens: list[str], lease: float) -> int:
    now = timezone.now()
    return JoinedWorker.objects.filter(holder__in=tokens).update(
        held_until=now + dt.timedelta(seconds=lease), last_seen_at=now
    )


class Identities:
    """The identities this process holds: checked in, renewed, reconciled, released.

    Owned by the runtime; its methods run on the relay's event loop.
    """

    def __init__(self, instance: str, pepper: str, lease: float) -> None:
        self.instance = instance
        self.pepper = pepper
        self.lease = lease
        #: hold token -> (the hold, what holds it)
        self.held: dict[str, tuple[Hold, Holder]] = {}
        self._renewed = 0.0

    async def join(self, token: str, name: str, address: str) -> Joined:
        """Trade a join token for a new worker's credential (raises :class:`JoinError`)."""
        return await in_thread(redeem, token, name, address, self.pepper)

    async def check_in(self, credential: str, wanted: str | None, address: str) -> Hold:
        """Verify a connecting worker's credential and take its identity's hold.

        Raises :class:`Refused`; ``wanted``: the provider the connection asked for.
        """
        token = f"{self.instance}:{secrets.token_hex(8)}"
        return await in_thread(_claim, credential, wanted, self.pepper, token, self.lease, address)

    def track(self, hold: Hold, holder: Holder) -> None:
        """``holder`` (its socket accepted) keeps ``hold`` until :meth:`release`."""
        self.held[hold.token] = (hold, holder)

    async def still_held(self, hold: Hold) -> str | None:
        """At register: why the connection must close after all, or None."""
        return await in_thread(_still_held, hold)

    async def release(self, hold: Hold) -> None:
        """The socket closed (or was refused after the check-in): let the identity go."""
        self.held.pop(hold.token, None)
        try:
            await in_thread(_release, hold.token)
        except Exception:
            # The hold lapses by itself after WORKER_LEASE_SECS.
            logger.exception("could not release the hold of worker #%d", hold.identity)

    async def reconcile(self, now: float) -> None:
        """Close what the database says this process no longer holds; renew the rest.

        Called by the runtime at every sync tick (``now``: loop time). Costs one query
        while anything is held, and one more every third of a lease.
        """
        if not self.held:
            return
        states = await in_thread(_states, sorted({h.identity for h, _ in self.held.values()}))
        for token, (hold, holder) in list(self.held.items()):
            revoked, current = states.get(hold.identity, (True, ""))
            reason = REVOKED if revoked else (TAKEN if current != token else None)
            if reason is not None:
                logger.warning(
                    "closing worker %r (#%d, provider %s): %s",
                    hold.name,
                    hold.identity,
                    hold.provider.name,
                    reason,
                )
                del self.held[token]
                holder.close_for(reason)
        if self.held and now - self._renewed >= self.lease / 3:
            await in_thread(_renew, list(self.held), self.lease)
            self._renewed = now
