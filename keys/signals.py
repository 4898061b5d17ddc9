"""Refresh the running relay's key cache at once when a key changes in this process."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from keys.models import ApiKey


@receiver(post_save, sender=ApiKey)
@receiver(post_delete, sender=ApiKey)
def key_changed(sender: type[ApiKey], instance: ApiKey, **kwargs: Any) -> None:
    from relay.server import control

    # After commit: other processes re-read the table when told, and must see the row.
    transaction.on_commit(control.keys_changed)
