"""The admin JSON API (``/admin/*``), for operators' scripts and ``manage.py``.

Every route needs ``Authorization: Bearer $MODELRELAY_ADMIN_TOKEN`` (compared in
constant time); without a configured token every route answers 403. Errors are
``{"detail": "..."}`` with 400 for malformed input, never 500.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from datetime import datetime
from typing import Annotated, Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI, Schema, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer
from pydantic import Field

from keys.models import ApiKey
from keys.services import create_key, revoke_key, update_key
from relay.core import snapshot
from relay.core.deadlines import MAX_DEADLINE_MS
from relay.core.limits import MAX_WEIGHT
from relay.server import runtime
from relay.server.cluster.control import ClusterUnreachable
from relay.server.cluster.limits import RedisLimitStore
from relay.server.cluster.streamstore import RedisStreams
from workers_app.joining import (
    MAX_TTL_SECS,
    MAX_USES,
    MIN_TTL_SECS,
    describe,
    joined_workers,
    mint_token,
    revoke_token,
    revoke_worker,
)
from workers_app.models import JoinedWorker, JoinToken, Provider

#: The longest drain deadline an operator may set: a day. A draining worker takes no new
#: work, so an endless (or absurd) deadline would take it out of service for good.
MAX_DRAIN_SECS = 86400.0
#: The most rows a list of join tokens or joined workers returns.
MAX_LISTED = 1000
DRAIN_TIMEOUT_RULE = (
    f"a finite number of seconds, greater than 0 and at most {MAX_DRAIN_SECS:g} (a day)"
)


def valid_drain_timeout(value: float) -> bool:
    """Whether ``value`` may be a drain deadline (the dashboard and ``manage.py drain``
    check with this too, before anything changes)."""
    return math.isfinite(value) and 0 < value <= MAX_DRAIN_SECS


class AdminToken(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> str | None:
        expected = settings.MODELRELAY_ADMIN_TOKEN
        if expected and hmac.compare_digest(token.encode(), expected.encode()):
            return "admin"
        return None


api = NinjaAPI(
    title="ModelRelay admin API",
    version="1",
    urls_namespace="admin_api",
    auth=AdminToken(),
    docs_url=None,
    openapi_url=None,
)


@api.exception_handler(AuthenticationError)
def forbidden(request: HttpRequest, exc: Exception) -> HttpResponse:
    detail = (
        "admin API disabled: set MODELRELAY_ADMIN_TOKEN"
        if not settings.MODELRELAY_ADMIN_TOKEN
        else "invalid admin token"
    )
    return api.create_response(request, {"detail": detail}, status=403)


@api.exception_handler(ValidationError)
def bad_request(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    problems = []
    for error in exc.errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "payload"))
        problems.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return api.create_response(
        request, {"detail": "; ".join(problems) or "invalid input"}, status=400
    )


ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^,\n]+$")]
ServiceClass = Literal["priority", "default", "flex"]


class KeyLimitsIn(Schema):
    """A key's limits (SPEC §13); null or absent means no limit (weight: 1)."""

    max_concurrent: int | None = Field(default=None, ge=1, strict=True)
    requests_per_minute: int | None = Field(default=None, ge=1, strict=True)
    tokens_per_day: int | None = Field(default=None, ge=1, strict=True)
    tokens_per_month: int | None = Field(default=None, ge=1, strict=True)
    #: Models the key may use; null: every model.
    allowed_models: list[ModelName] | None = Field(default=None, min_length=1, max_length=1000)
    expires_at: datetime | None = None
    weight: int | None = Field(default=None, ge=1, le=MAX_WEIGHT, strict=True)
    #: Priority classes (SPEC §15); null: ``default``.
    default_class: ServiceClass | None = None
    max_class: ServiceClass | None = None
    #: The first-token deadline of a request that states none (SPEC §21); null: none.
    deadline_ms: int | None = Field(default=None, ge=1, le=MAX_DEADLINE_MS, strict=True)


class KeyIn(KeyLimitsIn):
    name: str = Field(min_length=1, max_length=100)


class KeyPatch(KeyLimitsIn):
    """Only the fields sent are changed; send null to lift a limit."""

    name: str | None = Field(default=None, min_length=1, max_length=100)


class KeyOut(Schema):
    id: int
    name: str
    prefix: str
    active: bool
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    max_concurrent: int | None
    requests_per_minute: int | None
    tokens_per_day: int | None
    tokens_per_month: int | None
    allowed_models: list[str] | None = None
    expires_at: datetime | None
    weight: int
    default_class: str
    max_class: str
    deadline_ms: int | None = None

    @staticmethod
    def resolve_allowed_models(obj: ApiKey) -> list[str] | None:
        return obj.allowed_model_list


class NewKeyOut(KeyOut):
    secret: str


class DrainIn(Schema):
    # Validated before any state changes: an infinite deadline used to fail after the
    # worker was marked draining, leaving it draining forever behind a 500.
    timeout_secs: float | None = Field(
        default=None, gt=0, le=MAX_DRAIN_SECS, allow_inf_nan=False, strict=True
    )
    reason: str = Field(default="maintenance", max_length=100)


class Accepted(Schema):
    id: str
    status: str


@api.get("/workers")
async def list_workers(request: HttpRequest) -> list[dict[str, Any]]:
    return await runtime.current().workers()


@api.get("/stats")
async def stats(request: HttpRequest) -> dict[str, Any]:
    rt = runtime.current()
    document = snapshot.stats(rt.relay)
    document["request_log"] = {
        "pending": len(rt.bookkeeper.pending),
        "dropped": rt.bookkeeper.dropped,
        "write_failures": rt.bookkeeper.failures,
    }
    if rt.placement is not None:
        # Counters above are this process's; the cluster's shared queue is one for all.
        document["cluster"] = rt.placement.describe()
        # The speeds every process predicts from (SPEC §21), as last shared.
        document["cluster"]["speeds"] = rt.placement.shared_view()
    # Who is using the pool (SPEC §13): running and queued here, tokens from the
    # limit store (every process's with Redis), refusals here by outcome.
    document["keys"] = await rt.key_usage()
    document["limits"] = {
        "store": "redis" if isinstance(rt.limit_store, RedisLimitStore) else "memory",
        "store_failures": rt.limiter.store_failures,
    }
    if isinstance(rt.limit_store, RedisLimitStore):
        # Admitted within this process's share while Redis could not answer.
        document["limits"]["by_share"] = rt.limit_store.fallbacks
    # Resumable responses (SPEC §18): this process's.
    resumable = document["streams"]["resumable"] = rt.streams.describe()
    resumable["store"] = "redis" if isinstance(rt.streams.store, RedisStreams) else "memory"
    return document


@api.post("/workers/{worker_id}/drain", response={202: Accepted})
async def drain(request: HttpRequest, worker_id: str, payload: DrainIn | None = None) -> Any:
    payload = payload or DrainIn()
    rt = runtime.current()
    try:
        drained = await rt.drain(worker_id, drain_secs=payload.timeout_secs, reason=payload.reason)
    except ClusterUnreachable as exc:
        raise HttpError(503, f"the other server processes cannot be reached: {exc}") from exc
    if not drained:
        raise HttpError(404, f"no connected worker with id '{worker_id}'")
    return Status(202, {"id": worker_id, "status": "draining"})


@api.post("/workers/{worker_id}/refresh", response={202: Accepted})
async def refresh(request: HttpRequest, worker_id: str) -> Any:
    try:
        asked = await runtime.current().refresh(worker_id, reason="operator")
    except ClusterUnreachable as exc:
        raise HttpError(503, f"the other server processes cannot be reached: {exc}") from exc
    if not asked:
        raise HttpError(404, f"no connected worker with id '{worker_id}'")
    return Status(202, {"id": worker_id, "status": "refresh requested"})


@api.get("/keys", response=list[KeyOut])
async def list_keys(request: HttpRequest) -> list[ApiKey]:
    return [key async for key in ApiKey.objects.all()]


@api.post("/keys", response={201: NewKeyOut})
async def new_key(request: HttpRequest, payload: KeyIn) -> Any:
    limits = payload.model_dump(exclude={"name"}, exclude_unset=True)
    try:
        made = await sync_to_async(create_key)(payload.name, **limits)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None
    await _in_force()
    made.key.secret = made.secret  # type: ignore[attr-defined]  # shown this once
    return Status(201, made.key)


@api.patch("/keys/{key_id}", response=KeyOut)
async def change_key(request: HttpRequest, key_id: int, payload: KeyPatch) -> Any:
    key = await ApiKey.objects.filter(id=key_id).afirst()
    if key is None:
        raise HttpError(404, f"no API key with id {key_id}")
    changes = payload.model_dump(exclude_unset=True)
    if "name" in changes and changes["name"] is None:
        raise HttpError(400, "name: a key needs a name")
    try:
        changed = await sync_to_async(update_key)(key, **changes)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None
    await _in_force()
    return changed


@api.delete("/keys/{key_id}", response={204: None})
async def delete_key(request: HttpRequest, key_id: int) -> Any:
    key = await ApiKey.objects.filter(id=key_id).afirst()
    if key is None:
        raise HttpError(404, f"no API key with id {key_id}")
    if not await sync_to_async(revoke_key)(key):
        raise HttpError(404, f"API key {key_id} is already revoked")
    await _in_force()
    return Status(204, None)


async def _in_force() -> None:
    """A key change answers once this process's key table holds it: a client may use a
    new key, or finds a revoked one refused, the moment the call returns."""
    rt = runtime.peek()
    if rt is not None and rt.loop is asyncio.get_running_loop():
        await rt.synced()


# -- joining (SPEC §22) ---------------------------------------------------------------------


class JoinTokenIn(Schema):
    provider: str = Field(min_length=1, max_length=64)
    #: Seconds it stays usable; null: JOIN_TOKEN_TTL_SECS.
    ttl_secs: float | None = Field(
        default=None, ge=MIN_TTL_SECS, le=MAX_TTL_SECS, allow_inf_nan=False
    )
    uses: int = Field(default=1, ge=1, le=MAX_USES, strict=True)


class JoinTokenOut(Schema):
    id: int
    prefix: str
    provider: str
    uses: int
    used: int
    state: str
    created_at: datetime
    expires_at: datetime
    created_by: str
    revoked_at: datetime | None

    @staticmethod
    def resolve_provider(obj: JoinToken) -> str:
        return obj.provider.name

    @staticmethod
    def resolve_state(obj: JoinToken) -> str:
        return obj.state()


class NewJoinTokenOut(JoinTokenOut):
    token: str


class JoinedWorkerOut(Schema):
    id: int
    name: str
    provider: str
    prefix: str
    created_at: datetime
    last_seen_at: datetime | None
    last_address: str
    connected: bool
    revoked_at: datetime | None


@api.post("/join-tokens", response={201: NewJoinTokenOut})
async def new_join_token(request: HttpRequest, payload: JoinTokenIn) -> Any:
    provider = await Provider.objects.filter(name=payload.provider).afirst()
    if provider is None:
        raise HttpError(404, f"no provider '{payload.provider}'")
    try:
        made = await sync_to_async(mint_token)(
            provider, ttl_secs=payload.ttl_secs, uses=payload.uses, created_by="api"
        )
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None
    made.token.token = made.secret  # type: ignore[attr-defined]  # shown this once
    return Status(201, made.token)


@api.get("/join-tokens", response=list[JoinTokenOut])
async def list_join_tokens(request: HttpRequest) -> list[JoinToken]:
    return [t async for t in JoinToken.objects.select_related("provider")[:MAX_LISTED]]


@api.delete("/join-tokens/{token_id}", response={204: None})
async def delete_join_token(request: HttpRequest, token_id: int) -> Any:
    token = await JoinToken.objects.filter(id=token_id).afirst()
    if token is None:
        raise HttpError(404, f"no join token with id {token_id}")
    await sync_to_async(revoke_token)(token)
    return Status(204, None)


@api.get("/joined-workers", response=list[JoinedWorkerOut])
async def list_joined_workers(request: HttpRequest) -> list[dict[str, object]]:
    return await sync_to_async(lambda: [describe(w) for w in joined_workers()[:MAX_LISTED]])()


@api.delete("/joined-workers/{worker_id}", response={204: None})
async def revoke_joined_worker(request: HttpRequest, worker_id: int) -> Any:
    worker = await JoinedWorker.objects.filter(id=worker_id).afirst()
    if worker is None:
        raise HttpError(404, f"no joined worker with id {worker_id}")
    if not await sync_to_async(revoke_worker)(worker):
        raise HttpError(404, f"joined worker {worker_id} is already revoked")
    return Status(204, None)
