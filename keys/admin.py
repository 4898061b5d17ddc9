"""Django admin for client API keys: the secret is shown once, at creation."""

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
        "created_at",
        "last_used_at",
        "revoked_at",
        "requests",
        "prompt_tokens",
        "completion_tokens",
    )
    list_filter = ("revoked_at",)
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
