"""Joining (SPEC §22): a worker trades a join token for a credential of its own.

``POST /v1/worker/join`` with a :class:`JoinRequest` as JSON; the relay answers 201 with
a :class:`JoinAnswer`, or an error in the OpenAI envelope (``{"error": {"message",
"type", "code"}}``) whose message says why: an unknown, spent, expired or revoked
token (401), a disabled provider (403), too many failed attempts from this address
(429, with ``Retry-After``), a body over :data:`MAX_JOIN_BYTES` (413). The worker then
connects with the credential in the ``X-Worker-Credential`` header (:data:`CREDENTIAL_HEADER`)
instead of the provider's ``X-Worker-Secret``.

Both sides use these definitions: the relay decodes the request with them (bounded),
the worker the answer.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PATH = "/v1/worker/join"
#: The largest join request body: a token and a name fit in far less.
MAX_JOIN_BYTES = 4096
#: The largest answer the worker reads.
MAX_ANSWER_BYTES = 64 * 1024
CREDENTIAL_HEADER = "X-Worker-Credential"
#: The prefixes of join tokens and of workers' credentials (like ``mrw_`` for provider
#: secrets and ``mrk_`` for API keys).
TOKEN_KIND = "mrj"
CREDENTIAL_KIND = "mrc"

Token = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
WorkerName = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


class JoinRequest(msgspec.Struct, forbid_unknown_fields=True):
    token: Token
    #: The name the worker registers with (``--worker-name``).
    name: WorkerName


class JoinAnswer(msgspec.Struct):
    #: The worker's identity on the relay (what the admin lists and revokes).
    worker_id: int
    name: str
    provider: str
    #: Shown this once; the relay keeps only its hash.
    credential: str


decode_request = msgspec.json.Decoder(JoinRequest).decode
decode_answer = msgspec.json.Decoder(JoinAnswer).decode
encode = msgspec.json.Encoder().encode
