"""Tell the running relay at once when a provider changes in this process.

Changes made by other processes reach it through the periodic provider sync (and
the channel layer when Redis is configured).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from workers_app.models import Provider


@receiver(post_save, sender=Provider)
@receiver(post_delete, sender=Provider)
def provider_changed(sender: type[Provider], instance: Provider, **kwargs: Any) -> None:
    from relay.server import control

    # After commit: other processes re-read the table when told, and must see the row.
    transaction.on_commit(control.providers_changed)
