"""Client API keys: shown once, stored as a lookup prefix plus an HMAC."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from relay.core.credentials import generate_secret, hash_secret, lookup_prefix


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

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def assign_new_secret(self) -> str:
        """Give the key a fresh secret and return it (it is not stored in clear)."""
        secret = generate_secret("mrk")
        self.prefix = lookup_prefix(secret)
        self.key_hash = hash_secret(secret, settings.SECRET_PEPPER)
        return secret
