"""Django admin for providers and the read-only worker session audit."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.html import format_html

from relay.server import control
from workers_app import services
from workers_app.models import ConnectedWorker, Provider, RequestLog, WorkerSession


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


class ReadOnlyAdmin(admin.ModelAdmin):
    """Audit records: viewable, never edited."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
    actions = ("rotate_secret", "rotate_secret_and_disconnect", "enable", "disable")
    fieldsets = (
        (None, {"fields": ("name", "enabled", "description", "secret_prefix")}),
        ("Models", {"fields": ("declared_models", "exclusive_models", "model_aliases")}),
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

    def _rotate(
        self, request: HttpRequest, queryset: QuerySet[Provider], *, disconnect: bool
    ) -> None:
        for provider in queryset:
            rotation = services.rotate_secret(provider, disconnect=disconnect)
            _show_secret_once(request, rotation.provider, rotation.secret)
            messages.info(request, rotation.outcome())

    # Actions run for anyone who may see the list: each names the permission it needs.
    @admin.action(
        description="Rotate worker secret (connected workers keep running)",
        permissions=["change"],
    )
    def rotate_secret(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        self._rotate(request, queryset, disconnect=False)

    @admin.action(
        description="Rotate worker secret and disconnect connected workers",
        permissions=["change"],
    )
    def rotate_secret_and_disconnect(
        self, request: HttpRequest, queryset: QuerySet[Provider]
    ) -> None:
        self._rotate(request, queryset, disconnect=True)

    @admin.action(description="Enable selected providers", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        for provider in queryset:
            provider.enabled = True
            provider.save(update_fields=["enabled", "updated_at"])

    @admin.action(
        description="Disable selected providers (fails their queues, closes their workers)",
        permissions=["change"],
    )
    def disable(self, request: HttpRequest, queryset: QuerySet[Provider]) -> None:
        for provider in queryset:
            provider.enabled = False
            provider.save(update_fields=["enabled", "updated_at"])


@admin.register(WorkerSession)
class WorkerSessionAdmin(ReadOnlyAdmin):
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


@admin.register(RequestLog)
class RequestLogAdmin(ReadOnlyAdmin):
    list_display = (
        "created_at",
        "request_id",
        "api_key",
        "model",
        "endpoint",
        "worker_name",
        "status",
        "outcome",
        "streamed",
        "queue_wait_ms",
        "ttfb_ms",
        "duration_ms",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "tokens_estimated",
        "requeues",
        "service_class",
        "preemptions",
        "resumable",
    )
    list_filter = (
        "outcome",
        "streamed",
        "endpoint",
        "provider",
        "status",
        "service_class",
        "resumable",
    )
    # Searching by key name or prefix shows one key's requests and its refusals
    # (outcomes such as over_daily_budget or over_concurrency, SPEC §13).
    search_fields = (
        "request_id",
        "model",
        "worker_name",
        "worker_id",
        "api_key__name",
        "api_key__prefix",
    )
    date_hierarchy = "created_at"
    list_select_related = ("api_key",)


async def _live_workers() -> list[dict[str, Any]]:
    return await control.workers()


async def _act(action: str, worker_id: str) -> bool:
    if action == "drain":
        return await control.drain(worker_id, reason="drained from the admin")
    return await control.refresh(worker_id, reason="requested from the admin")


@admin.register(ConnectedWorker)
class ConnectedWorkerAdmin(ReadOnlyAdmin):
    """The live worker registry (of every process, with Redis), with drain and refresh."""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if request.method == "POST":
            if not request.user.has_perm("workers_app.drain_worker"):
                messages.error(request, "You may not drain or refresh workers.")
                return HttpResponseRedirect(request.path)
            action = request.POST.get("action", "")
            worker_id = request.POST.get("worker_id", "")
            try:
                done = action in ("drain", "refresh") and async_to_sync(_act)(action, worker_id)
            except control.ClusterUnreachable as exc:
                messages.error(request, f"The other server processes cannot be reached: {exc}")
                return HttpResponseRedirect(request.path)
            if done:
                verb = "Draining" if action == "drain" else "Asked to refresh models:"
                messages.success(request, f"{verb} {worker_id}")
            else:
                messages.error(request, f"No connected worker {worker_id}")
            return HttpResponseRedirect(request.path)
        context = {
            **self.admin_site.each_context(request),
            "title": "Connected workers",
            "opts": self.model._meta,
            "workers": async_to_sync(_live_workers)(),
            "can_act": request.user.has_perm("workers_app.drain_worker"),
        }
        return TemplateResponse(request, "admin/workers_app/connected_workers.html", context)
