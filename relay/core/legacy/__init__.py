"""The legacy bridge (SPEC §12): nodes and clients of the older broker, unchanged.

``frames`` (the old node wire: connect parameters, task and stop frames, binary
results, close codes), ``tasks`` (an OpenAI or Anthropic request as a node task, and
what a node refuses), ``render`` (a node's text deltas as OpenAI or Anthropic
responses, streamed or whole), ``bridge`` (one node connection as a worker of the
core) and ``oldapi`` (the old client API, ``POST /api/chat``, translated to and from
a chat completion).

Django-free like the rest of :mod:`relay.core`; the sockets and the HTTP handler
that use it live in :mod:`relay.server.legacy` and :mod:`relay.server.legacy.oldapi`.
"""
