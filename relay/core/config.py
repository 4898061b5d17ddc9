"""Typed, frozen configuration handed to the relay core.

The Django edge builds a :class:`RelayConfig` from settings once; each provider row
becomes a :class:`ProviderPolicy` whose ``None`` overrides fall back to the config.
Tests build these directly with sub-second timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relay.core.affinity import AffinityConfig
from relay.core.speed import SpeedConfig
from relay.wire.protocol import ACCEPTED_PROTOCOL_VERSIONS

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DeadlineConfig:
    """First-token deadlines (SPEC §21, :mod:`relay.core.deadlines`), the DEADLINE_MS_*
    settings: priority class -> the deadline (milliseconds) of a request of that class
    that states none and whose key gives none (absent: none)."""

    by_class: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    """Hedged priority streams (SPEC §21, :mod:`relay.core.hedging`), the HEDGE_* settings."""

    #: The most hedges, as a share of ``priority`` requests (HEDGE_MAX_SHARE; 0: off).
    max_share: float = 0.0
    #: The least time a ``priority`` stream waits for its first byte before it is
    #: hedged (HEDGE_MIN_DELAY_MS), whatever its predicted p95.
    min_delay: float = 0.05


@dataclass(frozen=True, slots=True)
class RelayConfig:
    max_queue_len: int = 100
    queue_timeout: float = 30.0
    request_timeout: float = 300.0
    heartbeat_interval: float = 15.0
    heartbeat_timeout: float = 45.0
    register_timeout: float = 10.0
    max_requeue_count: int = 3
    max_models_per_worker: int = 256
    max_model_name_len: int = 256
    max_worker_name_len: int = 128
    max_concurrent_cap: int = 4096
    max_message_bytes: int = 64 * MIB
    max_stream_bytes: int = 256 * MIB
    max_request_bytes: int = 32 * MIB
    #: What the relay buffers for one streaming client that reads slower than its
    #: worker writes, and for all of them together (see SPEC §6 "Slow readers").
    stream_buffer_bytes: int = 4 * MIB
    stream_buffer_total_bytes: int = 256 * MIB
    #: A client that takes nothing for this long while its response waits is cut off.
    stall_timeout: float = 60.0
    #: A stream's client that left after its last event does not cancel it: the request
    #: waits this long at most for its completion (and usage) before it is cancelled.
    stream_end_grace: float = 5.0
    model_memory: float = 600.0
    drain_timeout: float = 300.0
    shutdown_grace: float = 30.0
    accepted_protocol_versions: frozenset[str] = ACCEPTED_PROTOCOL_VERSIONS
    require_protocol_version: bool = False
    #: How many finished-request records are kept for the request log writer.
    record_buffer: int = 10_000
    #: Public model name -> backend model id, for every provider (MODEL_ALIASES).
    aliases: dict[str, str] = field(default_factory=dict)
    #: Priority classes (SPEC §15): a request waiting longer than this counts one class
    #: higher (None: never); a ``flex`` request loses its slot to a higher class at most
    #: this often before its first byte, then keeps it.
    priority_aging: float | None = 60.0
    max_preemptions: int = 3
    #: Cache-aware routing (SPEC §14): ROUTING_POLICY and the AFFINITY_* settings.
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    #: Requests that do not generate (token counting, see
    #: :data:`relay.core.routes.NON_GENERATING`) one worker runs at once, beside its
    #: generation slots (NON_GENERATING_PER_WORKER).
    non_generating_per_worker: int = 4
    #: Models on demand (SPEC §19): how long requests wait for their model to be loaded
    #: (MODEL_LOAD_TIMEOUT_SECS); how long a loaded model's queue may stay waiting
    #: before a second copy loads where a model slot is free (MODEL_SCALE_OUT_WAIT_SECS,
    #: 0: never); how long a loaded model may sit idle before it is unloaded
    #: (MODEL_IDLE_UNLOAD_SECS, 0: never).
    model_load_timeout: float = 300.0
    model_scale_out_wait: float = 10.0
    model_idle_unload: float = 0.0
    #: Speed-aware routing (SPEC §21): how speeds are learned (RATES_*), first-token
    #: deadlines' defaults per class (DEADLINE_MS_*), hedging (HEDGE_*).
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    hedging: HedgeConfig = field(default_factory=HedgeConfig)


@dataclass(frozen=True, slots=True)
class ProviderPolicy:
    """A provider as the core sees it: routing switches and effective limits."""

    name: str
    enabled: bool = True
    declared_models: frozenset[str] = field(default_factory=frozenset)
    #: Models only this provider's workers may serve (see SPEC §4, model squatting).
    exclusive_models: frozenset[str] = field(default_factory=frozenset)
    #: Public model name -> this provider's backend model id (before the server's).
    aliases: dict[str, str] = field(default_factory=dict)
    max_queue_len: int = 100
    queue_timeout: float = 30.0
    request_timeout: float = 300.0
    max_models_per_worker: int = 256
    #: Workers admitted under a lower value are closed (their secret was rotated away).
    eviction: int = 0

    @classmethod
    def from_overrides(
        cls,
        config: RelayConfig,
        name: str,
        *,
        enabled: bool = True,
        declared_models: frozenset[str] | None = None,
        exclusive_models: frozenset[str] | None = None,
        aliases: dict[str, str] | None = None,
        max_queue_len: int | None = None,
        queue_timeout: float | None = None,
        request_timeout: float | None = None,
        max_models_per_worker: int | None = None,
        eviction: int = 0,
    ) -> ProviderPolicy:
        return cls(
            name=name,
            enabled=enabled,
            declared_models=declared_models or frozenset(),
            exclusive_models=exclusive_models or frozenset(),
            aliases=dict(aliases or {}),
            max_queue_len=config.max_queue_len if max_queue_len is None else max_queue_len,
            queue_timeout=config.queue_timeout if queue_timeout is None else queue_timeout,
            request_timeout=config.request_timeout if request_timeout is None else request_timeout,
            max_models_per_worker=(
                config.max_models_per_worker
                if max_models_per_worker is None
                else max_models_per_worker
            ),
            eviction=eviction,
        )
