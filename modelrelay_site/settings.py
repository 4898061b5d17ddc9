"""Django settings for ModelRelay, read from the environment in one place.

Every timing and size limit has a name and a documented default (README, "Settings").
``*_SECS`` values accept decimals so tests and demos can use sub-second timings.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from modelrelay_site.env import (
    env_aliases,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
    persisted_secret,
)

if TYPE_CHECKING:
    from relay.server.cluster.redisconf import RedisTarget

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("DATA_DIR", str(BASE_DIR / "var"))).resolve()


def private_data_dir() -> Path:
    """DATA_DIR, created owner-only (0700) when missing: it holds the generated secrets
    and the SQLite database, whose sessions would let any local user into the admin."""
    DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    return DATA_DIR


MIB = 1024 * 1024

# --- Django core -------------------------------------------------------------

DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("DJANGO_SECRET_KEY", "") or persisted_secret(
    private_data_dir() / "secret_key", nbytes=48
)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# HTTPS as seen through the TLS proxy in front (deploy/, docs/DEPLOY.md). Trust
# X-Forwarded-Proto only when that proxy is yours and sets it (the nginx and Caddy
# configs in deploy/ do); otherwise any client could claim to be on HTTPS.
if env_bool("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# manage.py commands call the admin JSON API on the loopback address over plain HTTP;
# public plain-HTTP requests are redirected by nginx/Caddy before they get here.
SECURE_REDIRECT_EXEMPT = [r"^admin/"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "relay",
    "workers_app",
    "keys",
    "batches",
]

MIDDLEWARE = [
    "relay.server.admin.errors.AdminJsonErrors",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "modelrelay_site.urls"
ASGI_APPLICATION = "modelrelay_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Persistent connections leak under ASGI (one connection per short-lived thread),
# so connections are never kept; PostgreSQL gets psycopg's pool instead.
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", "") or f"sqlite:///{private_data_dir() / 'db.sqlite3'}",
        conn_max_age=0,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env_int("DATABASE_POOL_SIZE", 10, minimum=1),
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    # Tests use a file too, not Django's shared-cache memory database: its table locks
    # fail at once ("database table is locked") where a file waits for the lock, and
    # the relay reads from background threads while tests write.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test-db.sqlite3")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env_str("STATIC_ROOT", "") or None  # set for collectstatic (Docker)
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Serve static files straight from the finders: `make run` needs no collectstatic step.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "/django-admin/login/"
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# --- Channels ----------------------------------------------------------------

REDIS_URL = env_str("REDIS_URL", "")
REDIS_PREFIX = env_str("REDIS_PREFIX", "modelrelay")
# Or a replicated Redis (or Valkey) watched by Sentinel (SPEC §20, docs/CLUSTER.md): the
# sentinels (host:port list) and the name they know the master by, instead of REDIS_URL;
# the passwords of the master (and its replicas) and of the sentinels, and TLS to both.
REDIS_SENTINELS = env_list("REDIS_SENTINELS", [])
REDIS_SENTINEL_MASTER = env_str("REDIS_SENTINEL_MASTER", "")
REDIS_SENTINEL_PASSWORD = env_str("REDIS_SENTINEL_PASSWORD", "")
REDIS_PASSWORD = env_str("REDIS_PASSWORD", "")
REDIS_TLS = env_bool("REDIS_TLS", False)
REDIS_TLS_CA_FILE = env_str("REDIS_TLS_CA_FILE", "")
# The longest any Redis call waits for its reply: a Redis that stops answering makes the
# process degraded within this, never holds a request up longer.
REDIS_TIMEOUT_SECS = env_float("REDIS_TIMEOUT_SECS", 1.0)


def _redis_target() -> RedisTarget | None:
    from relay.server.cluster.redisconf import TargetError, parse_target

    try:
        return parse_target(
            url=REDIS_URL,
            sentinels=REDIS_SENTINELS,
            master=REDIS_SENTINEL_MASTER,
            password=REDIS_PASSWORD,
            sentinel_password=REDIS_SENTINEL_PASSWORD,
            tls=REDIS_TLS,
            tls_ca_file=REDIS_TLS_CA_FILE,
            timeout=REDIS_TIMEOUT_SECS,
        )
    except TargetError as exc:
        raise ImproperlyConfigured(str(exc)) from None


#: Where the cluster's Redis is (None: one process, no Redis): every use of Redis is
#: built from it (relay/server/cluster/redissource.py).
REDIS_TARGET = _redis_target()
# Cluster mode: the URL at which the other server processes reach this one (default:
# http://<listen host>:<port>, the host name when listening on all interfaces).
CLUSTER_ADVERTISE_URL = env_str("CLUSTER_ADVERTISE_URL", "")
# How often each process re-asserts its share of the cluster's state in Redis (and reads
# back what it may have missed), and how long that state outlives a silent process.
# Priority classes (SPEC §15): a request waiting longer than this counts one class higher
# (0: never), and a flex request loses its slot to a higher class at most this often.
PRIORITY_AGING_SECS = env_float("PRIORITY_AGING_SECS", 60.0)
PRIORITY_MAX_PREEMPTIONS = env_int("PRIORITY_MAX_PREEMPTIONS", 3)
# Cache-aware routing (SPEC §14, relay/core/affinity.py): the policy, the session header
# that names a conversation, the block size of prompt hashing, what the index keeps
# (blocks per worker, explicit keys), the bounded-load guard (factor and slack), the
# share of a prompt a prefix match must cover to decide, and whether API keys share
# prefixes (off: each key is routed by its own alone, so no key learns of another's).
# (predicted: the worker predicted to send the first token soonest, SPEC §21, below.)
ROUTING_POLICY = env_str("ROUTING_POLICY", "cache_aware")
if ROUTING_POLICY not in ("cache_aware", "least_load", "predicted"):
    raise ImproperlyConfigured(
        f"ROUTING_POLICY must be cache_aware, least_load or predicted, got {ROUTING_POLICY!r}"
    )
AFFINITY_SESSION_HEADER = env_str("AFFINITY_SESSION_HEADER", "X-Session-Id").lower()
AFFINITY_BLOCK_BYTES = env_int("AFFINITY_BLOCK_BYTES", 1024, minimum=16)
AFFINITY_WORKER_BLOCKS = env_int("AFFINITY_WORKER_BLOCKS", 16384, minimum=1)
AFFINITY_MAX_KEYS = env_int("AFFINITY_MAX_KEYS", 100_000, minimum=1)
AFFINITY_LOAD_FACTOR = env_float("AFFINITY_LOAD_FACTOR", 1.25)
AFFINITY_LOAD_SLACK = env_int("AFFINITY_LOAD_SLACK", 4, minimum=0)
AFFINITY_MIN_MATCH = env_float("AFFINITY_MIN_MATCH", 0.5)
AFFINITY_TTL_SECS = env_float("AFFINITY_TTL_SECS", 3600.0)
AFFINITY_SHARE_ACROSS_KEYS = env_bool("AFFINITY_SHARE_ACROSS_KEYS", False)
if AFFINITY_LOAD_FACTOR < 1.0:
    raise ImproperlyConfigured("AFFINITY_LOAD_FACTOR must be at least 1")
if not 0.0 <= AFFINITY_MIN_MATCH <= 1.0:
    raise ImproperlyConfigured("AFFINITY_MIN_MATCH must be between 0 and 1")
# Speed-aware routing (SPEC §21, relay/core/rates.py, prediction.py, deadlines.py,
# hedging.py): the half-life of learned speeds (a box that slows down is noticed within
# about one), how often a cluster's processes share them through Redis; the first-token
# deadline of a request of each class that states none and whose key gives none (0:
# none); hedging of priority streams (the most hedges as a share of priority requests,
# 0: off; the least wait before one).
RATES_HALF_LIFE_SECS = env_float("RATES_HALF_LIFE_SECS", 120.0)
RATES_SHARE_SECS = env_float("RATES_SHARE_SECS", 5.0)
DEADLINE_MS_PRIORITY = env_int("DEADLINE_MS_PRIORITY", 0)
DEADLINE_MS_DEFAULT = env_int("DEADLINE_MS_DEFAULT", 0)
DEADLINE_MS_FLEX = env_int("DEADLINE_MS_FLEX", 0)
for _name, _ms in (
    ("DEADLINE_MS_PRIORITY", DEADLINE_MS_PRIORITY),
    ("DEADLINE_MS_DEFAULT", DEADLINE_MS_DEFAULT),
    ("DEADLINE_MS_FLEX", DEADLINE_MS_FLEX),
):
    if _ms > 3_600_000:
        raise ImproperlyConfigured(f"{_name} must be at most 3600000 (an hour), got {_ms}")
HEDGE_MAX_SHARE = env_float("HEDGE_MAX_SHARE", 0.0, positive=False)
if HEDGE_MAX_SHARE > 1.0:
    raise ImproperlyConfigured(f"HEDGE_MAX_SHARE must be between 0 and 1, got {HEDGE_MAX_SHARE}")
HEDGE_MIN_DELAY_MS = env_int("HEDGE_MIN_DELAY_MS", 50, minimum=1)
# Requests that do not generate (token counting) one worker runs at once, besides and
# never in its generation slots.
NON_GENERATING_PER_WORKER = env_int("NON_GENERATING_PER_WORKER", 4, minimum=1)
CLUSTER_TICK_SECS = env_float("CLUSTER_TICK_SECS", 1.0)
#: Cluster mode: a request stays on a worker of the process that received it while that
#: worker has a free slot and at most this many requests in flight more than the least
#: loaded worker anywhere (0, the default: least load exactly, SPEC §6, this process first
#: on a tie only). A request placed on another process's worker passes through both
#: processes, every chunk of it.
CLUSTER_LOCAL_SLACK = env_int("CLUSTER_LOCAL_SLACK", 0, minimum=0)
CLUSTER_TTL_SECS = env_float("CLUSTER_TTL_SECS", 5.0)
if not 0 < CLUSTER_TICK_SECS < CLUSTER_TTL_SECS:
    raise ImproperlyConfigured("CLUSTER_TICK_SECS must be positive and below CLUSTER_TTL_SECS")
#: With Redis: a server process's per-key concurrency slots and token reservations stop
#: counting this long after it stopped renewing them (it died), so they never leak
#: (docs/OPERATIONS.md).
LIMITS_LEASE_SECS = env_float("LIMITS_LEASE_SECS", 15.0)
if REDIS_TARGET is not None:
    from relay.server.cluster.redisconf import channel_hosts

    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                # redis-py 8 defaults to a 5 s socket timeout, which kills idle receivers.
                "hosts": channel_hosts(REDIS_TARGET),
                "prefix": f"{REDIS_PREFIX}:asgi:",
                "capacity": 1000,
                "expiry": 30,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- ModelRelay --------------------------------------------------------------

LISTEN_ADDR = env_str("LISTEN_ADDR", "127.0.0.1:8080")
ASGI_SERVER = env_str("ASGI_SERVER", "daphne")
if ASGI_SERVER not in {"daphne", "uvicorn"}:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"ASGI_SERVER must be daphne or uvicorn, got {ASGI_SERVER!r}")
PUBLIC_URL = env_str("PUBLIC_URL", "")
PROVIDER_NAME = env_str("PROVIDER_NAME", "local")
WORKER_SECRET = env_str("WORKER_SECRET", "")
SECRET_PEPPER = env_str("MODELRELAY_SECRET_PEPPER", "") or persisted_secret(
    private_data_dir() / "pepper"
)

MAX_QUEUE_LEN = env_int("MAX_QUEUE_LEN", 100)
QUEUE_TIMEOUT_SECS = env_float("QUEUE_TIMEOUT_SECS", 30.0)
REQUEST_TIMEOUT_SECS = env_float("REQUEST_TIMEOUT_SECS", 300.0)
HEARTBEAT_INTERVAL_SECS = env_float("HEARTBEAT_INTERVAL_SECS", 15.0)
HEARTBEAT_TIMEOUT_SECS = env_float("HEARTBEAT_TIMEOUT_SECS", 45.0)
REGISTER_TIMEOUT_SECS = env_float("REGISTER_TIMEOUT_SECS", 10.0)
MAX_REQUEUE_COUNT = env_int("MAX_REQUEUE_COUNT", 3)
MAX_MODELS_PER_WORKER = env_int("MAX_MODELS_PER_WORKER", 256, minimum=1)
MAX_MODEL_NAME_LEN = env_int("MAX_MODEL_NAME_LEN", 256, minimum=1)
MAX_MESSAGE_BYTES = env_int("MAX_MESSAGE_BYTES", 64 * MIB, minimum=1024)
MAX_STREAM_BYTES = env_int("MAX_STREAM_BYTES", 256 * MIB, minimum=1)
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 32 * MIB, minimum=1024)
# What the relay holds for streaming clients that read slower than their workers write
# (per request and in total) before it pauses the stream at its source or ends it, and
# how long a client may read nothing at all before it is cut off (SPEC §6, slow readers).
STREAM_BUFFER_BYTES = env_int("STREAM_BUFFER_BYTES", 4 * MIB, minimum=1024)
STREAM_BUFFER_TOTAL_BYTES = env_int("STREAM_BUFFER_TOTAL_BYTES", 256 * MIB, minimum=1024)
STALL_TIMEOUT_SECS = env_float("STALL_TIMEOUT_SECS", 60.0)
# A streaming client that leaves after the stream's last event ([DONE], message_stop,
# response.completed) does not cancel it: its completion and usage are waited for this long.
STREAM_END_GRACE_SECS = env_float("STREAM_END_GRACE_SECS", 5.0, positive=False)
# Responses that outlive their client (SPEC §18: background mode, X-Conversation-Id): kept
# this long after they end, at most this many bytes each and in all (this process's),
# and at most this many per API key.
STREAM_RETAIN_SECS = env_float("STREAM_RETAIN_SECS", 600.0)
STREAM_RETAIN_BYTES = env_int("STREAM_RETAIN_BYTES", 8 * MIB, minimum=1024)
STREAM_RETAIN_TOTAL_BYTES = env_int("STREAM_RETAIN_TOTAL_BYTES", 256 * MIB, minimum=1024)
STREAM_RETAIN_PER_KEY = env_int("STREAM_RETAIN_PER_KEY", 256, minimum=1)
# The routes forwarded to workers by the body's model (relay/core/routes.py):
# "default", "/path", "/path=anthropic", "-/path". Checked here so a typo stops the start.
RELAY_ROUTES = env_list("RELAY_ROUTES", [])
# daphne shim (modelrelay_site/daphne_shim): patches to leave out ("all", or names), and
# whether to apply the rest on versions of daphne/Twisted/autobahn the tests never ran.
DAPHNE_SHIM_SKIP = env_list("DAPHNE_SHIM_SKIP", [])
DAPHNE_SHIM_UNTESTED = env_str("DAPHNE_SHIM_UNTESTED", "skip")
if DAPHNE_SHIM_UNTESTED not in ("skip", "apply"):
    raise ImproperlyConfigured("DAPHNE_SHIM_UNTESTED must be 'skip' or 'apply'")
# Public model names mapped to backend model ids for every provider (JSON object).
MODEL_ALIASES = env_aliases("MODEL_ALIASES")


def _check_routes() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from relay.core.routes import RouteError, parse_routes

    try:
        parse_routes(RELAY_ROUTES)
    except RouteError as exc:
        raise ImproperlyConfigured(str(exc)) from None


_check_routes()
MODEL_MEMORY_SECS = env_float("MODEL_MEMORY_SECS", 600.0, positive=False)
# Models on demand (SPEC §19): the wait for a load, a second copy for a model whose queue
# keeps waiting (0: never), unloading what sat idle (0: never).
MODEL_LOAD_TIMEOUT_SECS = env_float("MODEL_LOAD_TIMEOUT_SECS", 300.0)
MODEL_SCALE_OUT_WAIT_SECS = env_float("MODEL_SCALE_OUT_WAIT_SECS", 10.0, positive=False)
MODEL_IDLE_UNLOAD_SECS = env_float("MODEL_IDLE_UNLOAD_SECS", 0.0, positive=False)
DRAIN_TIMEOUT_SECS = env_float("DRAIN_TIMEOUT_SECS", 300.0)
SHUTDOWN_GRACE_SECS = env_float("SHUTDOWN_GRACE_SECS", 30.0, positive=False)
SYNC_SECS = env_float("SYNC_SECS", 1.0)
REQUEST_LOG_FLUSH_SECS = env_float("REQUEST_LOG_FLUSH_SECS", 1.0)
REQUIRE_PROTOCOL_VERSION = env_bool("REQUIRE_PROTOCOL_VERSION", False)

# Joining (SPEC §22): how long a join token minted without a TTL stays usable, and how
# long a joined worker's connection holds its identity in the database unless renewed
# (a second connection with the same credential is refused meanwhile; a process that
# died lets go after it). Renewed every third of it at the sync ticks, so never less than
# three SYNC_SECS (raised to that).
JOIN_TOKEN_TTL_SECS = env_float("JOIN_TOKEN_TTL_SECS", 3600.0)
WORKER_LEASE_SECS = max(env_float("WORKER_LEASE_SECS", 15.0), 3 * SYNC_SECS)

AUTH_MAX_FAILURES = env_int("AUTH_MAX_FAILURES", 5, minimum=1)
AUTH_FAILURE_WINDOW_SECS = env_float("AUTH_FAILURE_WINDOW_SECS", 60.0)
AUTH_BLOCK_SECS = env_float("AUTH_BLOCK_SECS", 300.0)
TRUSTED_PROXIES = env_list("TRUSTED_PROXIES", [])

MODELRELAY_ADMIN_TOKEN = env_str("MODELRELAY_ADMIN_TOKEN", "")
MODELRELAY_METRICS_TOKEN = env_str("MODELRELAY_METRICS_TOKEN", "")
MODELRELAY_REQUIRE_API_KEYS = env_bool("MODELRELAY_REQUIRE_API_KEYS", False)
CORS_ALLOWED_ORIGINS = env_list("CORS_ALLOWED_ORIGINS", [])
AUDIT_RETENTION_DAYS = env_int("AUDIT_RETENTION_DAYS", 30, minimum=1)

# Nodes of the older broker (SPEC §12, docs/LEGACY.md): a node sending more than
# LEGACY_BAD_FRAME_LIMIT bad frames within LEGACY_BAD_FRAME_WINDOW_SECS is closed;
# a request that sets no token limit gives the node this max_new_tokens.
LEGACY_BAD_FRAME_LIMIT = env_int("LEGACY_BAD_FRAME_LIMIT", 100, minimum=1)
LEGACY_BAD_FRAME_WINDOW_SECS = env_float("LEGACY_BAD_FRAME_WINDOW_SECS", 10.0)
LEGACY_DEFAULT_MAX_NEW_TOKENS = env_int("LEGACY_DEFAULT_MAX_NEW_TOKENS", 1024, minimum=1)

# Batches (SPEC §16, docs/OPERATIONS.md): the largest input file, the most requests per
# batch, lines this process runs at once (never more than free slots: a batch only fills
# idle capacity) and the free slots per model it leaves alone, the lines of one key's
# batches that may wait, what "24h" means, and the engine's timings (look for work,
# lease on a claimed line, write results). Each key (and everything uploaded without
# one) keeps at most so many files, of so many bytes in all.
BATCH_FILE_MAX_BYTES = env_int("BATCH_FILE_MAX_BYTES", 100 * MIB, minimum=1)
BATCH_MAX_FILES_PER_KEY = env_int("BATCH_MAX_FILES_PER_KEY", 100, minimum=1)
BATCH_MAX_FILE_BYTES_PER_KEY = env_int("BATCH_MAX_FILE_BYTES_PER_KEY", 1024 * MIB, minimum=1)
BATCH_MAX_LINES = env_int("BATCH_MAX_LINES", 50_000, minimum=1)
BATCH_MAX_IN_FLIGHT = env_int("BATCH_MAX_IN_FLIGHT", 64, minimum=1)
BATCH_SPARE_SLOTS = env_int("BATCH_SPARE_SLOTS", 0)
BATCH_MAX_QUEUED_LINES_PER_KEY = env_int("BATCH_MAX_QUEUED_LINES_PER_KEY", 100_000, minimum=1)
BATCH_COMPLETION_WINDOW_SECS = env_float("BATCH_COMPLETION_WINDOW_SECS", 86_400.0)
BATCH_POLL_SECS = env_float("BATCH_POLL_SECS", 1.0)
BATCH_CLAIM_SECS = env_float("BATCH_CLAIM_SECS", 60.0)
BATCH_FLUSH_SECS = env_float("BATCH_FLUSH_SECS", 0.25)
BATCH_RETENTION_DAYS = env_int("BATCH_RETENTION_DAYS", 30, minimum=1)

# Backend metrics federation (SPEC §17, GET /metrics/workers): the largest metrics
# sample a worker may send, in bytes and in series; a larger one is dropped (the worker
# is told, the connection stays).
WORKER_METRICS_MAX_BYTES = env_int("WORKER_METRICS_MAX_BYTES", 2 * MIB, minimum=1)
WORKER_METRICS_MAX_SERIES = env_int("WORKER_METRICS_MAX_SERIES", 10_000, minimum=1)

# OpenTelemetry traces (SPEC §17) are configured by the standard OTEL_* variables, read
# by relay/wire/telemetry.py and the SDK. This one is ours: whether a client's
# traceparent/tracestate is continued (true) or each request starts a new trace at the
# edge (false: the client's context decides nothing and goes nowhere).
OTEL_TRUST_INCOMING = env_bool("OTEL_TRUST_INCOMING", True)

# --- Logging -----------------------------------------------------------------

LOG_LEVEL = env_str("LOG_LEVEL", "info").upper()
if LOG_LEVEL not in {"TRACE", "DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"}:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"LOG_LEVEL must be one of debug, info, warning, error; got {LOG_LEVEL!r}"
    )
LOG_LEVEL = {"TRACE": "DEBUG", "WARN": "WARNING"}.get(LOG_LEVEL, LOG_LEVEL)

# text: one line per event; json: one JSON object per line, with request_id on every
# line about a request (the worker's LOG_FORMAT does the same on its side).
LOG_FORMAT = env_str("LOG_FORMAT", "text").lower()
if LOG_FORMAT not in ("text", "json"):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"LOG_FORMAT must be text or json; got {LOG_FORMAT!r}")

# One line per finished or refused request (relay.server.accesslog), logger
# relay.access at INFO whatever LOG_LEVEL says; false: none.
ACCESS_LOG = env_bool("ACCESS_LOG", True)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "modelrelay_site.logformat.OneLineFormatter",
            "format": "%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        },
        "json": {"()": "modelrelay_site.logformat.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if LOG_FORMAT == "json" else "plain",
        },
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "daphne": {"level": "WARNING"},
        # One line per admin-API call would drown the output of manage.py commands.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
        # Written by a thread of its own (relay.server.accesslog), through the same
        # handler as every other line so that lines never interleave.
        "relay.access": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
