"""Batches (SPEC §16): uploaded files, batches and one row per line of a batch.

The database is the truth every server process shares: a line is claimed by one
process at a time (a claim token and an expiry), its result is written once, on the
row of that line, and the output and error files are rendered from those rows. See
``relay/server/batches/`` for the engine that runs them and docs/OPERATIONS.md.
"""

from __future__ import annotations

import datetime as dt
import secrets

from django.db import models
from django.db.models import Q
from django.utils import timezone

from keys.models import ApiKey

# -- a batch's status (OpenAI's names; Anthropic's are derived from them) ------------
VALIDATING = "validating"
FAILED = "failed"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
STATUSES = (
    VALIDATING,
    FAILED,
    IN_PROGRESS,
    FINALIZING,
    COMPLETED,
    EXPIRED,
    CANCELLING,
    CANCELLED,
)
#: Statuses in which a batch still has work to do (lines to run, files to write).
ACTIVE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
#: Statuses a cancel request moves to ``cancelling``.
CANCELLABLE = (VALIDATING, IN_PROGRESS)

# -- a line's state and, once done, its outcome ----------------------------------------
PENDING = "pending"
CLAIMED = "claimed"
DONE = "done"
SUCCEEDED = "succeeded"
ERRORED = "errored"
CANCELED = "canceled"
LINE_EXPIRED = "expired"
OUTCOMES = (SUCCEEDED, ERRORED, CANCELED, LINE_EXPIRED)

OPENAI = "openai"
ANTHROPIC = "anthropic"


def new_id(prefix: str) -> str:
    """A public object id: ``prefix`` and 24 random characters (OpenAI's and Anthropic's shape)."""
    return prefix + secrets.token_hex(12)


class StoredFile(models.Model):
    """A file of the Files API: an uploaded batch input (its bytes in :class:`FileChunk`
    rows), or a batch's output or error file (rendered from the batch's lines when read)."""

    public_id = models.CharField(max_length=64, unique=True)
    key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE)
    purpose = models.CharField(max_length=32)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField(default=0)
    #: For an output or error file: its batch, and which of the two it is.
    batch = models.ForeignKey("Batch", null=True, blank=True, on_delete=models.CASCADE)
    kind = models.CharField(max_length=8, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = "file"

    def __str__(self) -> str:
        return f"{self.public_id} ({self.filename})"


class FileChunk(models.Model):
    """A piece of an uploaded file, in order. The bytes live apart from the file's row so
    that nothing that reads files or batches (lists, the engine) ever loads them; every
    server process reaches them through the database, whichever one took the upload.
    They go with their file (``CASCADE``, one ``DELETE`` without reading them)."""

    file = models.ForeignKey(StoredFile, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["file", "index"], name="file_chunk_index_unique")
        ]

    def __str__(self) -> str:
        return f"{self.file_id}#{self.index}"


class BatchQuerySet(models.QuerySet["Batch"]):
    def request_cancel(self) -> int:
        """Ask for these batches to be cancelled: those still validating or running
        become ``cancelling`` (the engine ends their lines); returns how many did."""
        return self.filter(status__in=CANCELLABLE).update(
            status=CANCELLING, cancelling_at=timezone.now()
        )


class Batch(models.Model):
    public_id = models.CharField(max_length=64, unique=True)
    #: Which API created it (and speaks for it): "openai" or "anthropic".
    api = models.CharField(max_length=16, default=OPENAI)
    key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE)
    endpoint = models.CharField(max_length=200)
    input_file_id = models.CharField(max_length=64, blank=True)
    completion_window = models.CharField(max_length=16, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, default=VALIDATING, db_index=True)
    #: Why validation failed: OpenAI's ``errors.data`` items.
    errors = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    #: Line tallies, kept in the same transaction as the lines they count.
    total = models.PositiveIntegerField(default=0)
    succeeded = models.PositiveIntegerField(default=0)
    errored = models.PositiveIntegerField(default=0)
    canceled = models.PositiveIntegerField(default=0)
    expired = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    #: Of the input tokens, those the backends reused from their prompt cache.
    cached_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    output_file_id = models.CharField(max_length=64, blank=True)
    error_file_id = models.CharField(max_length=64, blank=True)
    #: The server process validating or finalizing it now, until when.
    lease_token = models.CharField(max_length=32, blank=True, editable=False)
    lease_until = models.DateTimeField(null=True, blank=True, editable=False)

    objects = BatchQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.public_id

    @property
    def finished(self) -> int:
        return self.succeeded + self.errored + self.canceled + self.expired

    @property
    def ended_at(self) -> dt.datetime | None:
        return self.completed_at or self.expired_at or self.cancelled_at or self.failed_at


class BatchLine(models.Model):
    """One request of a batch: what to send, who holds it now, and its one result."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    model = models.CharField(max_length=256)
    body = models.TextField()
    state = models.CharField(max_length=8, default=PENDING)
    #: The claim of the process running it (``state == claimed``) and when it lapses.
    claim_token = models.CharField(max_length=32, blank=True)
    claimed_until = models.DateTimeField(null=True, blank=True)
    #: Attempts that failed on a worker (retried up to MAX_REQUEUE_COUNT).
    failures = models.PositiveSmallIntegerField(default=0)
    outcome = models.CharField(max_length=12, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = models.TextField(blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "index"], name="batch_line_index_unique")
        ]
        indexes = [models.Index(fields=["batch", "state", "index"], name="batch_line_state")]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index} ({self.custom_id})"


def claimable(now: dt.datetime) -> Q:
    """Lines no process holds: never claimed, or claimed by one whose claim lapsed."""
    return Q(state=PENDING) | Q(state=CLAIMED, claimed_until__lt=now)
