"""Django admin for client API keys: the secret is shown once, at creation; limits and
the fair-share weight are edited here too (SPEC §13)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from keys.models import ApiKey
from keys.services import revoke_key


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "prefix",
        "active",
        "weight",
        "default_class",
        "max_class",
        "deadline_ms",
        "limits",
        "expires_at",
        "created_at",
        "last_used_at",
        "revoked_at",
        "requests",
        "prompt_tokens",
        "completion_tokens",
    )
    list_filter = ("revoked_at",)
    fieldsets = (
        (None, {"fields": ("name", "prefix", "created_at", "revoked_at")}),
        (
            "Limits (empty: no limit)",
            {
                "fields": (
                    "max_concurrent",
                    "requests_per_minute",
                    ("tokens_per_day", "tokens_per_month"),
                    "allowed_models",
                    "expires_at",
                    "weight",
                    ("default_class", "max_class"),
                    "deadline_ms",
                ),
                "description": "Over a limit a client gets 429 with Retry-After (403 for a "
                "model not allowed, 401 once expired). See docs/OPERATIONS.md.",
            },
        ),
        (
            "Usage",
            {"fields": ("last_used_at", "requests", "prompt_tokens", "completion_tokens")},
        ),
    )
    search_fields = ("name", "prefix")
    actions = ("revoke",)
    readonly_fields = (
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
        "requests",
        "prompt_tokens",
        "completion_tokens",
    )

    @admin.display(boolean=True)
    def active(self, obj: ApiKey) -> bool:
        return obj.active

    @admin.display(description="limits")
    def limits(self, obj: ApiKey) -> str:
        parts = []
        if obj.max_concurrent is not None:
            parts.append(f"{obj.max_concurrent} at once")
        if obj.requests_per_minute is not None:
            parts.append(f"{obj.requests_per_minute}/min")
        if obj.tokens_per_day is not None:
            parts.append(f"{obj.tokens_per_day:,} tokens/day")
        if obj.tokens_per_month is not None:
            parts.append(f"{obj.tokens_per_month:,} tokens/month")
        models = obj.allowed_model_list
        if models is not None:
            parts.append(f"{len(models)} model(s)")
        return ", ".join(parts) or "none"

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        secret = None if change else obj.assign_new_secret()
        super().save_model(request, obj, form, change)
        if secret is not None:
            messages.warning(
                request,
                format_html(
                    "API key <b>{}</b> (shown only now; copy it): "
                    "<code style='user-select:all'>{}</code>",
                    obj.name,
                    secret,
                ),
            )

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = sum(1 for key in queryset if revoke_key(key))
        messages.success(request, f"revoked {revoked} key(s)")
