"""Client API keys: shown once, stored as a lookup prefix plus an HMAC; with optional
limits and a fair-share weight (SPEC §13, docs/OPERATIONS.md)."""

from __future__ import annotations

import re

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from relay.core.classes import CLASSES, DEFAULT
from relay.core.credentials import generate_secret, hash_secret, lookup_prefix
from relay.core.deadlines import MAX_DEADLINE_MS
from relay.core.limits import MAX_WEIGHT, KeyLimits

CLASS_CHOICES = [(name, name) for name in CLASSES]


def split_model_names(text: str) -> list[str]:
    """Allowed models are entered one per line or comma-separated."""
    out: list[str] = []
    for part in re.split(r"[,\n]", text or ""):
        name = part.strip()
        if name and name not in out:
            out.append(name)
    return out


class ApiKey(models.Model):
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    # -- limits (SPEC §13); empty means "no limit" --
    max_concurrent = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Most requests of this key queued or running at once (429 beyond).",
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="A burst of up to this many, refilled continuously (429 beyond).",
    )
    tokens_per_day = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Token budget per UTC day, prompt plus completion as the backends "
        "report them. A request that starts under budget finishes; the next gets 429.",
    )
    tokens_per_month = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Token budget per calendar month (UTC).",
    )
    allowed_models = models.TextField(
        blank=True,
        help_text="Models this key may use, as clients name them (one per line or "
        "comma-separated). Empty: every model. Others get 403.",
    )
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="After this the key is refused (401)."
    )
    weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_WEIGHT)],
        help_text="Share of the pool when keys compete for workers: a key of weight 3 "
        "gets three requests dispatched for every one of a key of weight 1.",
    )
    default_class = models.CharField(
        max_length=16,
        choices=CLASS_CHOICES,
        default=DEFAULT,
        help_text="The priority class of a request that asks for none (service_tier or "
        "X-Priority). priority goes first, flex runs on what is left and may be preempted.",
    )
    max_class = models.CharField(
        max_length=16,
        choices=CLASS_CHOICES,
        default=DEFAULT,
        help_text="The highest class this key's requests may ask for; asking above it is "
        "clamped to it, not refused.",
    )
    deadline_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_DEADLINE_MS)],
        help_text="Time to first token (ms) this key's requests accept when they state none "
        "(X-Deadline-Ms). A request no worker is predicted to answer in time is refused at "
        "once with 503 and Retry-After. Empty: the class's default, if any.",
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @property
    def allowed_model_list(self) -> list[str] | None:
        """The allowed models, or None for every model."""
        return split_model_names(self.allowed_models) or None

    def limits(self) -> KeyLimits:
        """The key's limits as the relay core sees them."""
        allowed = self.allowed_model_list
        return KeyLimits(
            max_concurrent=self.max_concurrent,
            requests_per_minute=self.requests_per_minute,
            tokens_per_day=self.tokens_per_day,
            tokens_per_month=self.tokens_per_month,
            allowed_models=None if allowed is None else frozenset(allowed),
            expires_at=None if self.expires_at is None else self.expires_at.timestamp(),
            weight=self.weight,
            default_class=self.default_class,
            max_class=self.max_class,
            deadline_ms=self.deadline_ms,
        )

    def assign_new_secret(self) -> str:
        """Give the key a fresh secret and return it (it is not stored in clear)."""
        secret = generate_secret("mrk")
        self.prefix = lookup_prefix(secret)
        self.key_hash = hash_secret(secret, settings.SECRET_PEPPER)
        return secret
