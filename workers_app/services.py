"""Provider and worker-session operations shared by the admin, the wizard and the commands."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from modelrelay_site.env import persisted_secret
from relay.core.credentials import hash_secret
from workers_app.models import Provider, SiteState, WorkerSession

logger = logging.getLogger("relay.providers")


@dataclass(frozen=True)
class Bootstrap:
    provider: Provider
    created: bool
    #: The provider's secret, or None when it cannot be known (rotated in the admin
    #: since the persisted one was generated).
    secret: str | None
    source: str
    #: Whether ``secret`` was generated just now (the one start that may show it whole).
    generated: bool = False


def bootstrap_default_provider(name: str, env_secret: str, data_dir: Path) -> Bootstrap:
    """Create or update the default provider at start.

    ``WORKER_SECRET`` set: it becomes the provider's secret. Unset: a secret is
    generated once, persisted in ``data_dir`` and used — unless an operator has
    since rotated the secret in the admin, which is then left alone.
    """
    with transaction.atomic():
        provider, created = Provider.objects.select_for_update().get_or_create(name=name)
        generated = False
        if env_secret:
            secret, source = env_secret, "WORKER_SECRET"
        else:
            path = data_dir / "worker_secret"
            generated = not path.exists()
            secret = persisted_secret(path, prefix="mrw_")
            source = str(path)
        if created or not provider.secret_hash or env_secret:
            if not provider.check_secret(secret):
                provider.set_secret(secret)
                provider.save()
            return Bootstrap(provider, created, secret, source, generated)
        if provider.check_secret(secret):
            return Bootstrap(provider, created, secret, source, generated)
        return Bootstrap(provider, created, None, "rotated in the admin")


@dataclass(frozen=True)
class Rotation:
    provider: Provider
    #: The new secret, in clear: show it once, never store it.
    secret: str
    #: Whether the provider's connected workers were told to disconnect.
    disconnect: bool
    #: How many were (this process's and those other processes list); None when they
    #: are disconnected only once an enclosing transaction commits.
    disconnected: int | None

    def outcome(self) -> str:
        """What happened to the workers already connected, in one sentence."""
        from relay.server.control import SECRET_ROTATED

        name = self.provider.name
        if not self.disconnect:
            return (
                f"Workers already connected to '{name}' keep running; any other worker "
                "needs the new secret to connect."
            )
        if self.disconnected is None:
            return f"Workers connected to '{name}' are disconnected once this change is saved."
        if self.disconnected == 0:
            return f"No worker of '{name}' was connected; any worker needs the new secret."
        return (
            f"Disconnected {self.disconnected} connected worker(s) of '{name}' (close 1008, "
            f'"{SECRET_ROTATED}"); they need the new secret to reconnect.'
        )


def rotate_secret(provider: Provider, *, disconnect: bool = False) -> Rotation:
    """Give ``provider`` a new worker secret; with ``disconnect``, evict its workers.

    Workers already connected were let in with the old secret: without ``disconnect``
    they keep running. With it, every worker of the provider on every server process is
    closed with 1008 "provider secret rotated" — after the new secret is committed, so a
    worker that reconnects at once is checked against the new one.
    """
    from relay.server import control

    with transaction.atomic():
        locked = Provider.objects.select_for_update().get(pk=provider.pk)
        secret = locked.rotate_secret()
        fields = ["secret_prefix", "secret_hash", "updated_at"]
        if disconnect:
            # Every process also closes them at its next provider sync, should the
            # broadcast below not reach it.
            locked.eviction += 1
            fields.append("eviction")
        locked.save(update_fields=fields)
    disconnected: list[int] = []
    if disconnect:
        name = locked.name
        # Runs at once outside a transaction, else when the enclosing one commits.
        transaction.on_commit(lambda: disconnected.append(control.disconnect_provider(name)))
    return Rotation(locked, secret, disconnect, disconnected[0] if disconnected else None)


def close_stale_sessions(reason: str = "server restarted") -> int:
    """Mark sessions a previous server process never closed as disconnected."""
    return WorkerSession.objects.filter(disconnected_at__isnull=True).update(
        disconnected_at=timezone.now(), disconnect_reason=reason
    )


#: What ``serve`` keeps private in DATA_DIR besides the database: the generated secrets.
SECRET_FILES = ("secret_key", "pepper", "worker_secret")
#: SQLite's companions of a database file, which hold recent writes (sessions too).
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def make_private(data_dir: Path, sqlite_database: Path | None) -> list[Path]:
    """Take group and other permissions away from DATA_DIR (0700), the generated secrets
    and the SQLite database with its -wal/-shm/-journal files (0600).

    Called by ``serve`` at start, for files made before it ran (by an older version, or
    a command run under a looser umask); it never widens a mode. Returns what changed.
    """
    targets = [(data_dir, 0o700), *((data_dir / name, 0o600) for name in SECRET_FILES)]
    if sqlite_database is not None:
        targets += [(Path(f"{sqlite_database}{suffix}"), 0o600) for suffix in SQLITE_SUFFIXES]
    changed = []
    for path, allowed in targets:
        try:
            mode = path.stat().st_mode & 0o7777
            if mode & ~allowed:
                os.chmod(path, mode & allowed)
                changed.append(path)
        except FileNotFoundError:
            continue
        except PermissionError as exc:
            logger.warning("could not make %s private: %s", path, exc)
    return changed


class PepperMismatch(Exception):
    pass


def check_pepper(pepper: str) -> None:
    """Refuse to run with a different HMAC pepper than the database was set up with.

    Secrets are stored as HMACs under the pepper: a process with another pepper would
    reject every worker secret and API key, and re-key the default provider under its
    own. Every process sharing a database must share MODELRELAY_SECRET_PEPPER.
    """
    fingerprint = hash_secret("modelrelay pepper check", pepper)
    state, _ = SiteState.objects.get_or_create(
        name="pepper_fingerprint", defaults={"value": fingerprint}
    )
    if state.value != fingerprint:
        raise PepperMismatch(
            "this database was set up with a different MODELRELAY_SECRET_PEPPER; every "
            "server process sharing a database must use the same pepper (see docs/DEPLOY.md)"
        )
