"""What the runtime reads from the database: providers as the core sees them, the active
API keys, the tokens each key spent.

The one place the server's edges touch the apps' models outside a request or a
socket's own ORM calls; every function here is synchronous and runs in a worker thread
(:func:`relay.server.bookkeeper.in_thread`). Imports the apps' models, never their
services: the apps call the server through :mod:`relay.server.control` only.
"""

from __future__ import annotations

import datetime as dt

from relay.core.config import ProviderPolicy, RelayConfig
from relay.core.keycache import KnownKey
from relay.core.limits import Periods
from workers_app.models import Provider


def provider_policy(provider: Provider, config: RelayConfig) -> ProviderPolicy:
    """A provider row as the core sees it (its overrides over the server's settings)."""
    return ProviderPolicy.from_overrides(
        config,
        provider.name,
        enabled=provider.enabled,
        declared_models=frozenset(provider.declared_model_list),
        exclusive_models=frozenset(provider.exclusive_model_list),
        aliases=provider.alias_map,
        max_queue_len=provider.max_queue_len,
        queue_timeout=provider.queue_timeout_secs,
        request_timeout=provider.request_timeout_secs,
        max_models_per_worker=provider.max_models_per_worker,
        eviction=provider.eviction,
    )


def load_providers(config: RelayConfig) -> list[ProviderPolicy]:
    return [provider_policy(p, config) for p in Provider.objects.all()]


def load_keys(
    seen: tuple[object, int] | None,
) -> tuple[tuple[object, int], dict[str, KnownKey] | None]:
    """Active keys, or None when nothing changed since ``seen`` (one cheap query)."""
    from django.db.models import Count, Max

    from keys.models import ApiKey

    summary = ApiKey.objects.aggregate(latest=Max("updated_at"), count=Count("id"))
    version = (summary["latest"], summary["count"])
    if version == seen:
        return version, None
    rows = ApiKey.objects.filter(revoked_at__isnull=True)
    return version, {
        key.prefix: KnownKey(id=key.id, key_hash=key.key_hash, name=key.name, limits=key.limits())
        for key in rows
    }


def load_spend(at: Periods) -> dict[int, tuple[int, int]]:
    """Tokens per key in the request log (today, this month) at ``at``."""
    from django.db.models import IntegerField, Q, Sum, Value
    from django.db.models.functions import Coalesce

    from workers_app.models import RequestLog

    day_start = dt.datetime.fromtimestamp(at.day_ends - 86_400, tz=dt.UTC)
    month_start = day_start.replace(day=1)
    tokens = Coalesce("prompt_tokens", Value(0)) + Coalesce("completion_tokens", Value(0))
    rows = (
        RequestLog.objects.filter(api_key__isnull=False, created_at__gte=month_start)
        .values("api_key")
        .annotate(
            month=Sum(tokens, output_field=IntegerField()),
            day=Sum(tokens, filter=Q(created_at__gte=day_start), output_field=IntegerField()),
        )
    )
    return {r["api_key"]: (r["day"] or 0, r["month"] or 0) for r in rows if r["month"]}
