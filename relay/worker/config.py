"""The worker's settings: one option table, read from flags, then the environment.

``worker.py`` calls :func:`parse_config` once at start-up and hands the frozen
:class:`Config` to everything else; imports nothing from Django. Every flag and its
environment variable are documented in ``docs/WORKER.md`` and
``deploy/worker.env.example``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Config:
    """Every setting, built by :func:`parse_config` (defaults live in ``OPTIONS``)."""

    proxy_url: str
    worker_secret: str  # "" when the worker joins with a token or has a credential
    provider: str
    worker_name: str
    backend_url: str  # "" until discovery found one (relay/worker/discovery.py)
    models: tuple[str, ...] | None  # None: discover from the backend
    max_concurrent: int | None  # None: ask the backend (llama-server /props), else 1
    model_refresh_secs: float
    max_message_bytes: int
    log_level: str
    log_format: str  # text or json (one object per line)
    backoff_min_secs: float
    backoff_max_secs: float
    fatal_retry_secs: float
    healthy_session_secs: float
    server_silence_secs: float  # 0: derived from the relay's ping period (register_ack)
    backend_connect_timeout: float
    backend_read_timeout: float | None
    backend_keepalive_secs: float
    discovery_timeout: float
    #: Backend metrics federation (SPEC §17): the backend's Prometheus endpoint (None:
    #: off), how often it is read, and how long one read may take.
    backend_metrics_url: str | None
    backend_metrics_secs: float
    backend_metrics_timeout: float
    backend_probe_min_secs: float
    backend_probe_max_secs: float
    #: Joining (SPEC §22): the join token to trade for a credential of this worker's
    #: own, where that credential is kept, and the ports backend discovery asks.
    join_token: str | None
    state_dir: str
    probe_ports: tuple[int, ...]
    #: This worker's own credential, once joined (set at start-up, never a flag).
    credential: str
    #: Models on demand (SPEC §19): whether the worker reports model states when its
    #: backend loads models on demand; how many models the backend holds at once when
    #: it does not say (None: no known bound); vLLM's runtime LoRA adapters it may load
    #: (name -> path); how often states are read from a backend without events, and
    #: how long one load or unload may take.
    model_states: bool
    models_max: int | None
    lora_adapters: tuple[tuple[str, str], ...]
    model_poll_secs: float
    model_op_timeout_secs: float

    @property
    def connect_url(self) -> str:
        scheme, rest = self.proxy_url.split("://", 1)
        ws_scheme = {"http": "ws", "https": "wss"}.get(scheme.lower(), scheme.lower())
        return f"{ws_scheme}://{rest}/v1/worker/connect?provider={quote(self.provider)}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """What the worker shows the relay at connect: its own credential once it has
        joined, else the provider's shared secret."""
        if self.credential:
            return {"X-Worker-Credential": self.credential}
        return {"X-Worker-Secret": self.worker_secret}

    def with_backend(self, url: str) -> Config:
        """This config with the backend discovery found (and its metrics endpoint, when
        none was given and metrics are on)."""
        metrics = self.backend_metrics_url
        if metrics == "":
            metrics = url + "/metrics"
        return dataclasses.replace(self, backend_url=url, backend_metrics_url=metrics)


def default_state_dir(env: Mapping[str, str]) -> str:
    """Where a worker keeps its credential unless told: the user's configuration
    directory (``%APPDATA%`` on Windows, else ``$XDG_CONFIG_HOME`` or ``~/.config``)."""
    if sys.platform == "win32" and env.get("APPDATA"):
        base = Path(env["APPDATA"])
    elif env.get("XDG_CONFIG_HOME"):
        base = Path(env["XDG_CONFIG_HOME"])
    else:
        base = Path.home() / ".config"
    return str(base / "modelrelay-worker")


#: The file in the state directory that keeps the worker's credential (relay/worker/credential.py).
CREDENTIAL_FILE = "credential.json"

#: The ports backend discovery asks, in this order: llama-server and llama-swap, vLLM,
#: Ollama, llama-swap's other usual port, LM Studio, SGLang.
USUAL_PORTS = (8080, 8000, 11434, 9292, 1234, 30000)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def _url(*schemes: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        parts = urlsplit(text.strip())
        if parts.scheme.lower() not in schemes or not parts.netloc:
            raise argparse.ArgumentTypeError(f"expected a {'/'.join(schemes)} URL, got {text!r}")
        return text.strip().rstrip("/")

    return check


def _models(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))


def _log_format(text: str) -> str:
    if text.lower() not in ("text", "json"):
        raise argparse.ArgumentTypeError("use text or json")
    return text.lower()


def _metrics_secs(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be from 0.1 to 3600 seconds, got {value}")
    return value


def _ports(text: str) -> tuple[int, ...]:
    ports: list[int] = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            port = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected port numbers, got {item.strip()!r}")
        if not 1 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"not a port: {port}")
        if port not in ports:
            ports.append(port)
    if not ports or len(ports) > 64:
        raise argparse.ArgumentTypeError("give from 1 to 64 ports")
    return tuple(ports)


def _join_token(text: str) -> str:
    token = text.strip()
    if not token.startswith("mrj_") or not 16 <= len(token) <= 100:
        raise argparse.ArgumentTypeError("a join token looks like mrj_… (minted by the relay)")
    return token


def _adapters(text: str) -> tuple[tuple[str, str], ...]:
    adapters: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected name=path, got {item.strip()!r}")
        adapters[name.strip()] = path.strip()
    return tuple(adapters.items())


def _level(text: str) -> str:
    if text.lower() not in ("debug", "info", "warning", "error"):
        raise argparse.ArgumentTypeError("use debug, info, warning or error")
    return text.lower()


#: flag, environment variable, default, parser, help (None: a tuning knob, hidden from
#: --help; tests shrink these instead of sleeping).
OPTIONS: list[tuple[str, str, str | None, Callable[[str], Any], str | None]] = [
    ("--proxy-url", "PROXY_URL", "http://127.0.0.1:8080", _url("http", "https", "ws", "wss"),
     "relay base URL; http becomes ws, https becomes wss"),
    ("--worker-secret", "WORKER_SECRET", None, str,
     "the provider's worker secret, sent as the X-Worker-Secret header; needed unless the "
     "worker joins with --join-token (or has joined before)"),
    ("--join-token", "JOIN_TOKEN", None, _join_token,
     "a join token minted on the relay (admin, /setup or manage.py create_join_token): "
     "traded at the first connect for a credential of this worker's own, kept in "
     "--state-dir and used from then on"),
    ("--state-dir", "WORKER_STATE_DIR", None, str,
     "where the worker keeps its credential (a file only its user can read); default: "
     "modelrelay-worker in the user's configuration directory"),
    ("--provider", "PROVIDER_NAME", "local", str,
     "provider (pool) to join with --worker-secret (a join token names its own)"),
    ("--worker-name", "WORKER_NAME", socket.gethostname(), str,
     "name shown in the dashboard and logs"),
    ("--backend-url", "BACKEND_URL", None, _url("http", "https"),
     "the local OpenAI-compatible server requests are forwarded to; omitted: found on this "
     "box's usual ports (llama-server, vLLM, Ollama, llama-swap, LM Studio, SGLang)"),
    ("--models", "MODELS", None, _models,
     "comma-separated models to serve; omitted: discovered from the backend's GET /v1/models "
     "(or Ollama's /api/tags) and refreshed periodically"),
    ("--max-concurrent", "MAX_CONCURRENT", None, _positive_int,
     "requests this box runs at once; omitted: llama-server's slot count (GET /props), else 1"),
    ("--model-refresh-secs", "MODEL_REFRESH_SECS", "60", _seconds,
     "how often discovered models are re-read"),
    ("--models-max", "MODELS_MAX", None, _positive_int,
     "how many models the backend holds in memory at once, for backends that load models on "
     "demand and do not say (Ollama's OLLAMA_MAX_LOADED_MODELS, llama-swap); omitted: no "
     "known bound (llama-server's router tells its --models-max itself)"),
    ("--lora-adapters", "LORA_ADAPTERS", None, _adapters,
     "vLLM with runtime LoRA updating: comma-separated name=path adapters the worker may "
     "load on the relay's word, each served as a model of that name"),
    ("--max-message-bytes", "MAX_MESSAGE_BYTES", str(64 * MIB), _positive_int,
     "largest WebSocket message; keep it equal to the relay's MAX_MESSAGE_BYTES"),
    ("--log-level", "LOG_LEVEL", "info", _level,
     "debug, info, warning or error; debug adds a line per request with its token counts"),
    ("--log-format", "LOG_FORMAT", "text", _log_format,
     "text, or json: one JSON object per line, with request_id on every line about a request"),
    ("--backend-metrics-url", "BACKEND_METRICS_URL", None, _url("http", "https"),
     "the backend's Prometheus endpoint, read and sent to the relay (GET /metrics/workers); "
     "omitted: BACKEND_URL/metrics"),
    ("--backend-metrics-secs", "BACKEND_METRICS_SECS", "15", _metrics_secs,
     "how often the backend's metrics (and this worker's own) are read and sent"),
    ("--backend-metrics-timeout", "BACKEND_METRICS_TIMEOUT_SECS", "5", _seconds, None),
    ("--backoff-min-secs", "WORKER_BACKOFF_MIN_SECS", "1", _seconds, None),
    ("--backoff-max-secs", "WORKER_BACKOFF_MAX_SECS", "30", _seconds, None),
    ("--fatal-retry-secs", "WORKER_FATAL_RETRY_SECS", "60", _seconds, None),
    ("--healthy-session-secs", "WORKER_HEALTHY_SESSION_SECS", "10", _seconds, None),
    ("--server-silence-secs", "SERVER_SILENCE_SECS", "0", _seconds, None),
    ("--backend-connect-timeout", "BACKEND_CONNECT_TIMEOUT_SECS", "10", _seconds, None),
    ("--backend-read-timeout", "BACKEND_READ_TIMEOUT_SECS", "600", _seconds, None),
    ("--backend-keepalive-secs", "BACKEND_KEEPALIVE_SECS", "4", _seconds, None),
    ("--discovery-timeout", "WORKER_DISCOVERY_TIMEOUT_SECS", "5", _seconds, None),
    ("--backend-probe-min-secs", "BACKEND_PROBE_MIN_SECS", "0.5", _seconds, None),
    ("--backend-probe-max-secs", "BACKEND_PROBE_MAX_SECS", "10", _seconds, None),
    ("--probe-ports", "MODELRELAY_PROBE_PORTS", ",".join(map(str, USUAL_PORTS)), _ports, None),
    ("--model-poll-secs", "MODEL_POLL_SECS", "2", _positive_seconds, None),
    ("--model-op-timeout-secs", "MODEL_OP_TIMEOUT_SECS", "600", _positive_seconds, None),
]  # fmt: skip


def program_name() -> str:
    """The command as the user typed it, for ``--help`` and errors."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if name in ("", "__main__.py", "-c"):
        return "python -m relay.worker"
    return name


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags first, then the environment, then defaults; exits with status 2 on bad input."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="Connect this GPU box's inference server to a ModelRelay relay. "
        "Every flag falls back to the environment variable named in its help.",
    )
    for flag, name, fallback, kind, text in OPTIONS:
        shown = f"env {name}, default {fallback}" if fallback else f"env {name}"
        parser.add_argument(
            flag,
            type=kind,
            metavar=name,
            default=env.get(name) or fallback,  # argparse parses string defaults with ``type``
            help=argparse.SUPPRESS if text is None else f"{text} ({shown})",
        )
    parser.add_argument(
        "--no-backend-metrics",
        action="store_true",
        default=env.get("BACKEND_METRICS", "").strip().lower() in ("0", "false", "no", "off"),
        help="send no metrics to the relay (env BACKEND_METRICS=off)",
    )
    parser.add_argument(
        "--no-model-states",
        action="store_true",
        default=env.get("MODEL_STATES", "").strip().lower() in ("0", "false", "no", "off"),
        help="register every model as always loaded, even when the backend loads models on "
        "demand (env MODEL_STATES=off)",
    )
    values = vars(parser.parse_args(argv))
    values["backend_url"] = values["backend_url"] or ""
    values["model_states"] = not values.pop("no_model_states")
    values["lora_adapters"] = values["lora_adapters"] or ()
    if values.pop("no_backend_metrics"):
        values["backend_metrics_url"] = None
    elif not values["backend_metrics_url"]:
        # "" until the backend is known (discovery): Config.with_backend derives it.
        backend = values["backend_url"]
        values["backend_metrics_url"] = backend + "/metrics" if backend else ""
    values["state_dir"] = values["state_dir"] or default_state_dir(env)
    values["worker_secret"] = values["worker_secret"] or ""
    values["credential"] = ""
    joined = (Path(values["state_dir"]) / CREDENTIAL_FILE).exists()
    if not values["worker_secret"] and not values["join_token"] and not joined:
        parser.error(
            "the worker needs a join token (--join-token or JOIN_TOKEN) or the "
            "provider's secret (--worker-secret or WORKER_SECRET)"
        )
    values["models"] = values["models"] or None
    values["backend_read_timeout"] = values["backend_read_timeout"] or None
    return Config(**values)
