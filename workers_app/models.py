"""Providers (pools of workers sharing a secret and limits) and worker audit rows."""

from __future__ import annotations

import datetime as dt
import re

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from relay.core.credentials import generate_secret, hash_secret, lookup_prefix, verify_secret

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_provider_name(value: str) -> None:
    if not _NAME_RE.match(value):
        raise ValidationError(
            "Use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."
        )


def parse_aliases(text: str) -> dict[str, str]:
    """``public name = backend model id``, one per line (``:`` works too)."""
    aliases: dict[str, str] = {}
    for number, line in enumerate((text or "").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        public, sep, target = line.replace(":", "=", 1).partition("=")
        if not sep or not public.strip() or not target.strip():
            raise ValidationError(f"line {number}: write 'public name = backend model id'")
        aliases[public.strip()] = target.strip()
    return aliases


def split_models(text: str) -> list[str]:
    """Declared models are entered one per line or comma-separated."""
    out: list[str] = []
    for part in re.split(r"[,\n]", text or ""):
        name = part.strip()
        if name and name not in out:
            out.append(name)
    return out


class Provider(models.Model):
    name = models.CharField(max_length=64, unique=True, validators=[validate_provider_name])
    enabled = models.BooleanField(default=True)
    description = models.CharField(max_length=200, blank=True)
    secret_prefix = models.CharField(max_length=16, blank=True, editable=False)
    secret_hash = models.CharField(max_length=64, blank=True, editable=False)
    declared_models = models.TextField(
        blank=True,
        help_text="Models this provider serves even while no worker is connected "
        "(one per line or comma-separated). Requests for them queue instead of 404.",
    )
    exclusive_models = models.TextField(
        blank=True,
        help_text="Models only this provider's workers may serve (one per line or "
        "comma-separated). A worker of another provider that advertises one is not acked "
        "for it, so it never receives that model's traffic. Leave empty when one provider "
        "serves everything.",
    )
    model_aliases = models.TextField(
        blank=True,
        help_text="Public model names clients may use for this provider's models, one per "
        "line as 'public name = backend model id' (e.g. 'gpt-4o-mini = qwen2.5-7b-instruct'). "
        "The request body a worker gets names the backend model; /v1/models lists both.",
    )
    max_queue_len = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Queue bound; empty uses MAX_QUEUE_LEN, 0 disables queueing.",
    )
    queue_timeout_secs = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001)],
        help_text="Empty uses QUEUE_TIMEOUT_SECS.",
    )
    request_timeout_secs = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001)],
        help_text="Empty uses REQUEST_TIMEOUT_SECS.",
    )
    max_models_per_worker = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Empty uses MAX_MODELS_PER_WORKER.",
    )
    eviction = models.PositiveIntegerField(
        default=0,
        editable=False,
        help_text="Raised each time every connected worker is disconnected (secret rotated): "
        "a worker admitted under a lower value is closed by whichever process holds it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def set_secret(self, secret: str) -> None:
        self.secret_prefix = lookup_prefix(secret)
        self.secret_hash = hash_secret(secret, settings.SECRET_PEPPER)

    def rotate_secret(self) -> str:
        """Give the provider a new secret and return it; it is not stored in clear."""
        secret = generate_secret("mrw")
        self.set_secret(secret)
        return secret

    def check_secret(self, secret: str) -> bool:
        return verify_secret(secret, settings.SECRET_PEPPER, self.secret_hash)

    @property
    def declared_model_list(self) -> list[str]:
        return split_models(self.declared_models)

    @property
    def exclusive_model_list(self) -> list[str]:
        return split_models(self.exclusive_models)

    @property
    def alias_map(self) -> dict[str, str]:
        try:
            return parse_aliases(self.model_aliases)
        except ValidationError:
            return {}  # refused by clean(); never routed half-parsed

    def clean(self) -> None:
        try:
            parse_aliases(self.model_aliases)
        except ValidationError as exc:
            raise ValidationError({"model_aliases": exc.messages}) from None
        claimed = set(self.exclusive_model_list)
        if not claimed:
            return
        others = Provider.objects.exclude(pk=self.pk).exclude(exclusive_models="")
        for other in others:
            clash = sorted(claimed & set(other.exclusive_model_list))
            if clash:
                raise ValidationError(
                    {
                        "exclusive_models": f"Already exclusive to provider {other.name!r}: "
                        + ", ".join(clash)
                    }
                )


class WorkerSession(models.Model):
    """One worker connection, written once when it registers and once when it leaves."""

    worker_id = models.CharField(max_length=64, unique=True)
    provider = models.ForeignKey(
        Provider, null=True, blank=True, on_delete=models.SET_NULL, related_name="sessions"
    )
    provider_name = models.CharField(max_length=64)
    worker_name = models.CharField(max_length=200)
    model_names = models.JSONField(default=list)
    max_concurrent = models.PositiveIntegerField(default=1)
    peer_address = models.CharField(max_length=64, blank=True)
    protocol_version = models.CharField(max_length=64, blank=True)
    connected_at = models.DateTimeField(db_index=True)
    disconnected_at = models.DateTimeField(null=True, blank=True, db_index=True)
    disconnect_reason = models.CharField(max_length=200, blank=True)
    requests_served = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-connected_at"]

    def __str__(self) -> str:
        return f"{self.worker_name} ({self.worker_id})"

    @classmethod
    def prune(cls, days: int) -> int:
        """Delete sessions that ended more than ``days`` ago; how many."""
        cutoff = timezone.now() - dt.timedelta(days=days)
        deleted, _ = cls.objects.filter(disconnected_at__lt=cutoff).delete()
        return deleted


class RequestLog(models.Model):
    """One finished (or rejected) client request, written in batches off the hot path."""

    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    api_key = models.ForeignKey(
        "keys.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="requests_log"
    )
    provider = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=256, blank=True)
    endpoint = models.CharField(max_length=64)
    worker_id = models.CharField(max_length=64, blank=True)
    worker_name = models.CharField(max_length=200, blank=True)
    status = models.PositiveSmallIntegerField()
    outcome = models.CharField(max_length=32)
    streamed = models.BooleanField(default=False)
    queue_wait_ms = models.FloatField(default=0.0)
    ttfb_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(default=0.0)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    #: Prompt tokens the backend said it reused from its cache (SPEC §14).
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    #: The backend reported no usage: the tokens are the worker's own count of the stream.
    tokens_estimated = models.BooleanField(default=False)
    requeues = models.PositiveSmallIntegerField(default=0)
    cancel_reason = models.CharField(max_length=32, blank=True)
    service_class = models.CharField(max_length=16, default="default")
    preemptions = models.PositiveSmallIntegerField(default=0)
    #: Its response outlived its client (SPEC §18): "background" (Responses background
    #: mode), "replay" (llama.cpp's X-Conversation-Id), or blank.
    resumable = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "request log entry"
        verbose_name_plural = "request log"

    def __str__(self) -> str:
        return f"{self.request_id or '(rejected)'} {self.model} {self.status}"


class ConnectedWorker(models.Model):
    """No table: gives the admin a "Connected workers" page showing the live registry."""

    class Meta:
        managed = False
        verbose_name = "connected worker"
        verbose_name_plural = "connected workers (live)"
        default_permissions = ("view",)
        permissions = [("drain_worker", "Can drain or refresh connected workers")]


class SiteState(models.Model):
    """Small facts about this installation that every server process must agree on."""

    name = models.CharField(max_length=64, unique=True)
    value = models.CharField(max_length=256)

    def __str__(self) -> str:
        return self.name


class JoinToken(models.Model):
    """A join token (SPEC §22): lets up to ``uses`` workers join ``provider`` before it
    expires, each trading it for a credential of its own. Shown once when minted; only a
    lookup prefix and an HMAC are kept, like provider secrets and API keys."""

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="join_tokens")
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, editable=False)
    uses = models.PositiveIntegerField(
        default=1, help_text="How many workers may join with it (1: single use)."
    )
    used = models.PositiveIntegerField(default=0, editable=False)
    expires_at = models.DateTimeField(db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    #: Who minted it: "admin: NAME", "setup: NAME", "api", "manage.py".
    created_by = models.CharField(max_length=100, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.provider.name})"

    def state(self, now: dt.datetime | None = None) -> str:
        """usable, used, expired or revoked."""
        now = now or timezone.now()
        if self.revoked_at is not None:
            return "revoked"
        if self.used >= self.uses:
            return "used"
        if self.expires_at <= now:
            return "expired"
        return "usable"


class JoinedWorker(models.Model):
    """A worker that joined with a token: its own credential, of which only a lookup
    prefix and an HMAC are kept. Revoking it closes its connection (whichever server
    process holds it) and refuses it from then on; every other worker stays."""

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="joined_workers")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    credential_hash = models.CharField(max_length=64, editable=False)
    joined_with = models.ForeignKey(
        JoinToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    last_address = models.CharField(max_length=64, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    #: The connection that holds this identity now ("" when none) and until when that
    #: hold stands unless renewed: a second connection is refused meanwhile, and a
    #: server process that died lets go by itself.
    holder = models.CharField(max_length=64, blank=True, editable=False)
    held_until = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.provider.name}, #{self.pk})"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def connected(self, now: dt.datetime | None = None) -> bool:
        return (
            bool(self.holder)
            and self.held_until is not None
            and (self.held_until > (now or timezone.now()))
        )
