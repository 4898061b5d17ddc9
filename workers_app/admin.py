"""Django admin for providers, join tokens and joined workers (SPEC §22), and the
read-only worker session audit."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from relay.server import control
from workers_app import joining, services
from workers_app.models import (
    ConnectedWorker,
    JoinedWorker,
    JoinToken,
    Provider,
    RequestLog,
    WorkerSession,
)


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
    # What tells one request from another, its status first, narrow enough for a
    # 1400 px window beside both of the admin's sidebars; the rest (request id,
    # endpoint, timings, requeues) is on each entry's page, searchable or filterable.
    list_display = (
        "at",
        "status",
        "outcome",
        "model",
        "api_key",
        "priority_class",
        "worker",
        "duration",
        "tokens",
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

    class Media:
        css = {"all": ("relay/admin.css",)}

    @admin.display(description="time", ordering="created_at")
    def at(self, obj: RequestLog) -> str:
        # The date hierarchy above the list says the day.
        return timezone.localtime(obj.created_at).strftime("%b %d %H:%M:%S")

    @admin.display(description="class", ordering="service_class")
    def priority_class(self, obj: RequestLog) -> str:
        if obj.preemptions:
            return f"{obj.service_class}, preempted {obj.preemptions}x"
        return obj.service_class

    @admin.display(description="worker", ordering="worker_name")
    def worker(self, obj: RequestLog) -> str:
        return obj.worker_name or "-"

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, obj: RequestLog) -> str:
        return f"{obj.duration_ms:,.0f} ms" if obj.request_id else "-"  # "-": refused

    @admin.display(description="tokens in / out")
    def tokens(self, obj: RequestLog) -> str:
        if obj.prompt_tokens is None and obj.completion_tokens is None:
            return "-"
        shown = f"{obj.prompt_tokens or 0:,} / {obj.completion_tokens or 0:,}"
        if obj.cached_tokens:
            shown += f" ({obj.cached_tokens:,} cached)"
        return shown + (" estimated" if obj.tokens_estimated else "")


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


class JoinTokenForm(forms.ModelForm):
    """Minting a join token: its provider, how many workers, how long (SPEC §22)."""

    ttl = forms.CharField(
        initial="1h",
        max_length=20,
        help_text="How long it stays usable: 90s, 30m, 1h, 7d (at most 30 days).",
    )

    class Meta:
        model = JoinToken
        fields = ("provider", "uses")

    def clean_ttl(self) -> float:
        try:
            return joining.parse_ttl(self.cleaned_data["ttl"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_uses(self) -> int:
        try:
            return joining.check_uses(self.cleaned_data["uses"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    """Join tokens: minted here (shown once), listed, revoked; never edited."""

    form = JoinTokenForm
    list_display = ("prefix", "provider", "state", "uses", "used", "expires_at", "created_by")
    list_filter = ("provider",)
    search_fields = ("prefix", "provider__name")
    list_select_related = ("provider",)
    actions = ("revoke",)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="state")
    def state(self, obj: JoinToken) -> str:
        return obj.state()

    def save_model(self, request: HttpRequest, obj: JoinToken, form: Any, change: bool) -> None:
        made = joining.mint_token(
            obj.provider,
            ttl_secs=form.cleaned_data["ttl"],
            uses=obj.uses,
            created_by=f"admin: {request.user.get_username()}",
        )
        obj.pk, obj.prefix = made.token.pk, made.token.prefix  # for the admin's log entry
        messages.warning(
            request,
            format_html(
                "Join token for provider <b>{}</b> (shown only now; copy it): "
                "<code style='user-select:all'>{}</code>. On the GPU box: "
                "<code>modelrelay-worker --proxy-url URL --join-token {}</code>",
                obj.provider.name,
                made.secret,
                made.secret,
            ),
        )

    def response_add(
        self, request: HttpRequest, obj: JoinToken, post_url_continue: Any = None
    ) -> HttpResponse:
        # The list, where the token is shown once (there is no change page to go to).
        return HttpResponseRedirect(reverse("admin:workers_app_jointoken_changelist"))

    @admin.action(description="Revoke selected join tokens", permissions=["delete"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[JoinToken]) -> None:
        revoked = sum(1 for token in queryset if joining.revoke_token(token))
        messages.success(request, f"revoked {revoked} join token(s)")


@admin.register(JoinedWorker)
class JoinedWorkerAdmin(admin.ModelAdmin):
    """Workers with a credential of their own: listed, renamed, revoked one by one."""

    list_display = (
        "name",
        "provider",
        "connected",
        "created_at",
        "last_seen_at",
        "last_address",
        "revoked_at",
    )
    list_filter = ("provider", "revoked_at")
    search_fields = ("name", "prefix", "last_address")
    list_select_related = ("provider",)
    fields = ("name", "provider", "prefix", "created_at", "last_seen_at", "last_address")
    readonly_fields = ("provider", "prefix", "created_at", "last_seen_at", "last_address")
    actions = ("revoke",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # workers join with a token

    @admin.display(boolean=True, description="connected")
    def connected(self, obj: JoinedWorker) -> bool:
        return obj.connected()

    @admin.action(
        description="Revoke selected workers (closes their connections; others stay)",
        permissions=["change"],
    )
    def revoke(self, request: HttpRequest, queryset: QuerySet[JoinedWorker]) -> None:
        revoked = sum(1 for worker in queryset if joining.revoke_worker(worker))
        messages.success(request, f"revoked {revoked} worker(s)")
