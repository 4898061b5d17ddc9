"""The client HTTP API's fast path, routed ahead of Django (SPEC §5).

``app`` (the ASGI router), ``request`` (reading a request, and refusing it before its
body when it will be refused anyway), ``inference`` (the relayed routes), ``respond``
(writing a relayed request's outcome: whole, or streamed with backpressure),
``info`` (``/health``, ``/metrics``, ``/v1/models`` and JSON 404/405), ``resume`` and
``reattach`` (responses that outlive their connection, and the routes that reattach to
them) and ``send`` (the response writers).
"""
