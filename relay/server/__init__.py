"""The server's edges around :mod:`relay.core`: thin Django/Channels adapters.

Sub-packages: ``http`` (the client API's fast path, routed ahead of Django),
``socket`` (the worker WebSocket endpoint), ``cluster`` (several processes through
Redis), ``legacy`` (the older broker's nodes and clients) and ``admin`` (the
``/admin/*`` JSON API). Modules: ``runtime`` (one relay per event loop, kept in sync
with the database), ``store`` (what the runtime reads from the database),
``control`` (the one interface the Django apps call), ``bookkeeper`` (request log and
key usage, written in batches), ``accesslog`` (a log line per request),
``metrics`` (Prometheus), ``federation`` (the workers' backend metrics,
``/metrics/workers``), ``tracing`` (OpenTelemetry, when ``OTEL_*`` turns it on) and
``cors``.

May import: :mod:`relay.core`, :mod:`relay.wire`, Django, Channels and the apps'
models (``workers_app``, ``keys``); never :mod:`relay.pages` or :mod:`relay.worker`.
"""
