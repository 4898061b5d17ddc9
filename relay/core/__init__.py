"""The server's relay logic: plain asyncio, no Django, configured by a frozen config.

``request`` (a relayed request and its mailbox), ``registry`` (connected workers,
indexed by model), ``queue`` (the bounded per-provider wait queue), ``dispatch``
and ``fleet`` (admission, routing, deadlines, cancellation, requeue, and the frames
that come from workers), ``config``, ``stats``, ``timeline`` and ``snapshot``
(read-only views), ``keycache``, ``credentials`` and ``ratelimit``.

May import: :mod:`relay.wire` and the standard library; never Django, Channels or
asgiref, nor :mod:`relay.server`, :mod:`relay.pages` or :mod:`relay.worker`.
"""
