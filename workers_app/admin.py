"""Django admin for providers and the read-only worker session audit."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from workers_app.models import Provider, WorkerSession


def _show_secret_once(request: HttpRequest, provider: Provider, secret: str) -> None:
    messages.warning(
        request,
        format_html(
            "Worker secret for provider <b>{}</b> (shown only now; copy it): "
            "<code style='user-select:all'>{}</code>",
            provider.name,
            secret,
        ),
    )


@admin.register(Provider)
class ProviderAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "enabled",
        "secret_prefix",
        "max_queue_len",
        "request_timeout_secs",
        "updated_at",
    )
    list_filter = ("enabled",)
    search_fields = ("name", "description")
    readonly_fields = ("secret_prefix", "created_at", "updated_at")
    actions = ("rotate_secret", "enable", "disable")
    fieldsets = (
        (None, {"fields": ("name", "enabled", "description", "secret_prefix")}),
        ("Models", {"fields": ("declared_models",)}),
        (
            "Limits (empty = server default)",
            {
                "fields": (
                    "max_queue_len",
                    "queue_timeout_secs",
                    "request_timeout_secs",
                    "max_models_per_worker",
                )
            },
        ),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    def save_model(self, request: HttpRequest, obj: Provider, form: Any, change: bool) -> None:
        secret = None if change and obj.secret_hash else obj.rotate_secret()
        super().save_model(request, obj, form, change)
        if secret is not None:
            _show_secret_once(request, obj, secret)

    @admin.action(description="Rotate worker secret (connected workers keep running)")
    def rotate_secret(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        for provider in queryset:
            secret = provider.rotate_secret()
            provider.save(update_fields=["secret_prefix", "secret_hash", "updated_at"])
            _show_secret_once(request, provider, secret)

    @admin.action(description="Enable selected providers")
    def enable(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        for provider in queryset:
            provider.enabled = True
            provider.save(update_fields=["enabled", "updated_at"])

    @admin.action(
        description="Disable selected providers (fails their queues, closes their workers)"
    )
    def disable(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        for provider in queryset:
            provider.enabled = False
            provider.save(update_fields=["enabled", "updated_at"])


@admin.register(WorkerSession)
class WorkerSessionAdmin(admin.ModelAdmin):
    list_display = (
        "worker_name",
        "provider_name",
        "worker_id",
        "peer_address",
        "connected_at",
        "disconnected_at",
        "disconnect_reason",
        "requests_served",
    )
    list_filter = ("provider_name", "disconnected_at")
    search_fields = ("worker_name", "worker_id", "peer_address")
    date_hierarchy = "connected_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
