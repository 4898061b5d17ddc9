"""The worker program's modules; ``worker.py`` at the top of the tree is its entry point.

``daemon`` (the program: start-up, the reconnect loop, draining; ``main`` is what
``worker.py``, the ``modelrelay-worker`` command and ``python -m relay.worker`` run),
``discovery`` (finding the backend on the box), ``credential`` (the worker's own
credential, traded for a join token and kept in a file), ``config`` (flags and
environment), ``session`` (one WebSocket connection to the
relay), ``outbox`` (the frames it writes), ``backend`` (discovery and forwarding to
the local inference server), ``pool`` (the keep-alive HTTP/1.1 connections requests
are forwarded on), ``connection`` (one of them) with ``http1`` (their message syntax,
read by llhttp), ``network`` (the discovery client's sockets), ``usage`` (token
counts read from backend responses) with ``stripper`` (the usage event a client did not
ask for, left out), ``modelhost`` (what a backend that loads models on demand offers; one module
per kind: ``llamarouter``, ``llamaswap``, ``ollama``, ``vllm``; ``recognition`` picks one),
``tracker`` (their models' states, kept current), ``operations`` (their loads and
unloads) and ``announcer`` (one connection's side of it). Shipped to GPU boxes, bundled
into ``/setup/worker.pyz`` and packaged as the ``modelrelay-worker`` wheel.

May import: :mod:`relay.wire`, ``websockets``, ``httpx``, ``msgspec`` and
``httptools``; never
:mod:`relay.core`, :mod:`relay.server`, :mod:`relay.pages` or Django.
"""
