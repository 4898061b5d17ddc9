"""Django admin for batches: their progress, and cancelling them; uploaded and output
files, read-only. Everything the running servers do with a batch they read from the
database, so a cancel here reaches every server process within BATCH_POLL_SECS."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from batches.models import ANTHROPIC, CANCELLING, FINALIZING, VALIDATING, Batch, StoredFile


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    # Its status first, narrow enough for a 1400 px window beside both of the admin's
    # sidebars (which API made it: its id's prefix and endpoint say, the filter too).
    list_display = (
        "public_id",
        "api_status",
        "progress",
        "key",
        "endpoint",
        "created",
        "expires",
    )
    list_filter = ("status", "api")
    search_fields = ("public_id", "input_file_id", "key__name")
    actions = ("cancel",)
    list_select_related = ("key",)
    fields = (
        "public_id",
        "api",
        "key",
        "endpoint",
        "input_file_id",
        "status",
        "progress",
        ("total", "succeeded", "errored", "canceled", "expired"),
        ("input_tokens", "cached_tokens", "output_tokens"),
        "output_file_id",
        "error_file_id",
        "errors",
        "metadata",
        "created_at",
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    )
    readonly_fields = tuple(
        name for item in fields for name in (item if isinstance(item, tuple) else (item,))
    )

    class Media:
        css = {"all": ("relay/admin.css",)}

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Batch) -> str:
        return timezone.localtime(obj.created_at).strftime("%b %d %H:%M")

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: Batch) -> str:
        return timezone.localtime(obj.expires_at).strftime("%b %d %H:%M")

    @admin.display(description="status", ordering="status")
    def api_status(self, obj: Batch) -> str:
        """The status as the batch's own API says it: Message Batches have only
        ``in_progress``, ``canceling`` and ``ended``."""
        if obj.api != ANTHROPIC:
            return obj.status
        if obj.status == CANCELLING:
            return "canceling"
        if obj.status in (VALIDATING, FINALIZING) or obj.ended_at is None:
            return "in_progress"
        return "ended"

    @admin.display(description="progress")
    def progress(self, obj: Batch) -> str:
        if not obj.total:
            return "-"
        done = obj.finished
        pct = round(100 * done / obj.total)
        failed = obj.errored + obj.canceled + obj.expired
        return format_html(
            '<progress max="{}" value="{}" title="{}%"></progress><br>{} of {} ({} failed)',
            obj.total,
            done,
            pct,
            done,
            obj.total,
            failed,
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.action(description="Cancel selected batches", permissions=["delete"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        cancelled = queryset.request_cancel()  # type: ignore[attr-defined]
        messages.success(request, f"cancelling {cancelled} batch(es)")


@admin.register(StoredFile)
class StoredFileAdmin(admin.ModelAdmin):
    list_display = ("public_id", "key", "filename", "purpose", "bytes", "batch", "created_at")
    list_filter = ("purpose",)
    search_fields = ("public_id", "filename", "key__name")
    list_select_related = ("key", "batch")
    fields = ("public_id", "key", "filename", "purpose", "bytes", "batch", "kind", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
