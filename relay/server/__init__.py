"""The server's edges around :mod:`relay.core`: thin Django/Channels adapters.

``http`` (the ASGI fast path for the client API, routed ahead of Django),
``consumers`` (the worker WebSocket endpoint), ``runtime`` (one relay per event loop,
kept in sync with the database), ``cluster`` (several processes through Redis),
``bookkeeper`` (request log and key usage, written in batches), ``redislimits``
(per-key limit counters shared through Redis), ``metrics``
(Prometheus), ``admin_api`` (the ``/admin/*`` JSON API), ``cors`` and ``rejecting``.

May import: :mod:`relay.core`, :mod:`relay.wire`, Django, Channels and the apps
(``workers_app``, ``keys``); never :mod:`relay.pages` or :mod:`relay.worker`.
"""
