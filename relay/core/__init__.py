"""The server's relay logic: plain asyncio, no Django, configured by a frozen config.

``state`` (the two live records: a connected worker and a relayed request),
``registry`` (workers indexed by model), ``queue`` (the per-provider wait queue's
interface) and ``fairqueue`` (its order: API keys in weighted round-robin),
``dispatch`` (admission, routing, deadlines, cancellation) with its bases ``providers``
(the provider table: which provider and model id a request goes to), ``cluster`` (its
side of cluster mode), ``capacity`` (worker loss, requeue, feeding the queue) and
``residency`` with ``upkeep`` (models on demand: what is loaded where; the choices
themselves in ``modelplan``),
speed-aware routing (SPEC §21): ``rates`` (learned speeds per worker and model),
``prediction`` (time to first token), ``deadlines`` and ``hedging`` (bases of the
dispatcher too),
``relay`` (the :class:`~relay.core.relay.Relay` the edges hold: the dispatcher plus
the frames that come from workers), ``config``, ``stats``, ``timeline`` and
``snapshot`` (read-only views), ``keycache``, ``credentials`` and ``ratelimit``;
``limits`` (per-key limits and admission), ``limitstore`` (their counters in memory)
and ``keystats`` (who is using the pool); ``streamlog`` (the log of a response that
outlives its client, and what stores of them offer), ``streamstore`` (those logs in
memory), ``keeper`` (the pumps that write them) and ``background`` (Responses background
mode's events and response object).

May import: :mod:`relay.wire` and the standard library; never Django, Channels or
asgiref, nor :mod:`relay.server`, :mod:`relay.pages` or :mod:`relay.worker`.
"""
