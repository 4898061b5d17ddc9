"""ModelRelay: one OpenAI/Anthropic-compatible endpoint in front of many GPU boxes.

Code map (imports go one way, down this list's arrows; ``tests/test_imports.py``
enforces it)::

    relay.wire    the worker <-> server wire format both programs share:
                  protocol messages, the error tree, SSE error events, header rules
    relay.worker  the worker program's modules (worker.py is its entry point)   -> wire
    relay.core    the server's relay logic, plain asyncio and no Django:
                  registry, queue, dispatch, deadlines, stats, key cache         -> wire
    relay.server  the server's edges: the ASGI fast path, the worker WebSocket
                  consumer, the runtime, cluster, bookkeeping, metrics, admin API -> core, wire
    relay.pages   the people-facing pages: dashboard, setup wizard, worker.pyz   -> server, core

What ships to a GPU box is ``worker.py`` plus ``relay/__init__.py``, ``relay/wire/``
and ``relay/worker/`` — nothing else, and none of it imports Django. The
``modelrelay-worker`` package (``pyproject.toml``) holds the same modules, with the
``modelrelay-worker`` command in place of ``worker.py``.
"""

__version__ = "0.1.0"
