"""Cache-aware routing (SPEC §14): send a conversation's next turn to the worker whose
backend still holds its prompt prefix.

Each request gets an :class:`Affinity` when it is admitted: the hash of an explicit key
(OpenAI's ``prompt_cache_key``, else the session header) and the chained hashes of
fixed-size blocks of its canonical prompt (system or instructions, tools, then the
messages, input or prompt, each as the client's JSON; seeded with the model and the API
key's scope). No tokenizer: a block is ``block_bytes`` of that JSON (a part's last block
may be shorter), and a block hash names the whole prefix that ends with it, so two
prompts share block *i* only if they share everything before it. A collision (xxh3, 64
bits) only ever changes where a request goes.

**Scope.** A backend that reports cached tokens (and the time a prompt takes) tells a
client whether its prompt was there already: were the index shared, one API key could
learn whether another sent a given prompt by sending it too. So the seed of every hash
of a request (its explicit key, its blocks, its cluster anchor) holds its API key's id
as well as its model, and the index of one key never matches another's: the per-worker
LRUs, what a reported miss removes and the cluster's conversation map all follow with
no other change. Requests without a key form one scope. An operator whose keys are one
tenant, or who wants a system prompt that all keys send reused, sets
``share_across_keys`` (AFFINITY_SHARE_ACROSS_KEYS): the seed is then the model's alone,
as if no request had a key.

:class:`Router` keeps, per worker, an LRU of the blocks it was last sent (at most
``worker_blocks``; the prefix blocks of a chain are touched last, so a worker's
blocks of one prompt stay a prefix as the LRU evicts) and an LRU of explicit keys. It
chooses among the workers that can take the request now (§6 decides which can):
the worker the key names, else the one holding the longest prefix when that prefix
covers at least ``min_match`` of the prompt — as long as its load stays within the
bounded-load guard ``load + 1 <= max(ceil(factor * (total + 1) / n), least + 1 +
slack)`` over those workers; otherwise it leaves the choice to least-load. It then
checks its guesses against what the backend says it reused (``cached_tokens`` in
``response_complete``): a predicted hit reported as a miss removes those blocks from
that worker's LRU. Everything here is bounded and forgotten with its worker.

Like the rest of the core, it is synchronous and runs on the event loop.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import msgspec
import xxhash

if TYPE_CHECKING:
    from relay.wire.protocol import TokenCounts


class Worker(Protocol):
    """What routing reads of a worker (:class:`relay.core.state.Worker`)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def load(self) -> int: ...


W = TypeVar("W", bound=Worker)


class RelayRequest(Protocol):
    """What routing reads of a request (:class:`relay.core.state.RelayRequest`)."""

    affinity: Affinity | None


#: ``predicted`` (SPEC §21): the worker predicted to send the first token soonest, the
#: cache one input of the prediction (:mod:`relay.core.prediction`), within the guard.
Policy = Literal["cache_aware", "least_load", "predicted"]
POLICIES: tuple[Policy, ...] = ("cache_aware", "least_load", "predicted")
#: Decisions, as counted: the key's or the longest prefix's worker took it ("hit"),
#: nothing was known ("miss"), or its holder was over the guard ("guard").
DECISIONS = ("hit", "miss", "guard")
#: The relay has no tokenizer: predicted cached tokens are estimated from bytes of JSON.
BYTES_PER_TOKEN = 4
#: Explicit keys longer than this are hashed from their first MAX_KEY_CHARS characters.
MAX_KEY_CHARS = 1024
#: Workers named in the per-worker counters; later ones are counted as ``(other)``.
MAX_WORKER_LABELS = 500

_hash = xxhash.xxh3_64_intdigest
_SEP = b"\x1e"
_EMPTY = msgspec.Raw(b"")


class Prompt(msgspec.Struct):
    """What routing reads of a client body, decoded in the same pass as ``model``.

    Each part is kept as the raw JSON the client sent (no copy, no parse); a part of
    an unexpected type only means no affinity for that request."""

    prompt_cache_key: Any = None
    system: msgspec.Raw = _EMPTY
    instructions: msgspec.Raw = _EMPTY
    tools: msgspec.Raw = _EMPTY
    messages: msgspec.Raw = _EMPTY
    input: msgspec.Raw = _EMPTY
    prompt: msgspec.Raw = _EMPTY


class _Role(msgspec.Struct):
    role: Any = None


_messages_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_role_decoder = msgspec.json.Decoder(_Role)


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    policy: Policy = "cache_aware"
    #: Bytes of canonical prompt per block (AFFINITY_BLOCK_BYTES).
    block_bytes: int = 1024
    #: Blocks hashed per prompt at most: the prefix beyond is not tracked.
    max_prompt_blocks: int = 4096
    #: Blocks remembered per worker (AFFINITY_WORKER_BLOCKS), LRU.
    worker_blocks: int = 16_384
    #: Explicit keys remembered (AFFINITY_MAX_KEYS), LRU.
    max_keys: int = 100_000
    #: Workers with a table (this process's and, in cluster mode, others'), LRU.
    max_workers: int = 4096
    #: The bounded-load guard (AFFINITY_LOAD_FACTOR, AFFINITY_LOAD_SLACK): a worker
    #: takes a request for its cache while its load stays within this factor of the
    #: mean, or within ``load_slack`` of the least loaded worker's.
    load_factor: float = 1.25
    load_slack: int = 4
    #: A prefix match decides only when it covers at least this share of the prompt
    #: (AFFINITY_MIN_MATCH): a new conversation that shares just a system prompt is
    #: placed least-load, so conversations spread before they grow.
    min_match: float = 0.5
    #: Cluster mode: how long Redis remembers a conversation's worker after its last
    #: turn (AFFINITY_TTL_SECS).
    cluster_ttl: float = 3600.0
    #: The session header (AFFINITY_SESSION_HEADER), lower case; the edge reads it.
    session_header: str = "x-session-id"
    #: Prefixes, explicit keys and session headers match across API keys
    #: (AFFINITY_SHARE_ACROSS_KEYS); off, each key routes only by its own.
    share_across_keys: bool = False


class Affinity:
    """A request's affinity: its explicit key, its block chain, and what was predicted."""

    __slots__ = (
        "_anchor",
        "_parts",
        "blocks",
        "decision",
        "head_sizes",
        "key",
        "predicted",
        "seed",
        "size",
    )

    def __init__(
        self,
        key: int | None,
        blocks: list[int],
        seed: int,
        parts: tuple[list[msgspec.Raw], msgspec.Raw] | None = None,
    ) -> None:
        self.key = key
        self.blocks = blocks
        self.seed = seed
        #: Bytes of each leading part (system, instructions, tools), and of the prompt.
        self.head_sizes: tuple[int, ...] = ()
        self.size = 0
        if parts is not None:
            self.head_sizes = tuple(len(p) for p in parts[0])
            self.size = sum(self.head_sizes) + len(parts[1])
        #: The prompt's parts, kept for :meth:`anchor` until :meth:`sent`.
        self._parts = parts
        self._anchor: str | None = None
        #: How many of ``blocks`` the chosen worker held when it was sent there.
        self.predicted = 0
        self.decision = ""

    def anchor(self) -> str:
        """What names the conversation across processes (cluster mode): its explicit
        key, else its system part, tools and first user message (what every later turn
        repeats, and what tells apart conversations sharing a system prompt); "" for
        neither.
        Computed on demand: only cluster mode asks."""
        if self._anchor is None:
            if self.key is not None:
                self._anchor = f"{self.key:016x}"
            elif self._parts is None:
                return ""
            else:
                head, body = self._parts
                self._anchor = f"{_hash(_SEP.join([*head, _first_turn(body)]), self.seed):016x}"
        return self._anchor

    def sent(self) -> None:
        """Drop the prompt's bytes (the anchor, once computed, is kept)."""
        self._parts = None

    def covered(self, depth: int, block_bytes: int) -> int:
        """Bytes of the prompt that its first ``depth`` blocks cover (a leading part's
        last block may be short)."""
        done = 0
        for size in self.head_sizes:
            count = -(-size // block_bytes)
            if depth <= count:
                return done + min(size, depth * block_bytes)
            done += size
            depth -= count
        return done + depth * block_bytes


def affinity_of(
    prompt: Prompt | None,
    model: str,
    session: str | None,
    key_id: int | None,
    config: AffinityConfig,
) -> Affinity | None:
    """The affinity of a request (None: nothing to route by); ``session`` is the value
    of its session header, ``key_id`` its API key (None: none)."""
    # The key's scope is the hash's own seed (no bytes added to hash): 0 (xxh3's
    # default) for no key and when keys share, so those hashes are the model's alone.
    scope = 0 if key_id is None or config.share_across_keys else key_id + 1
    seed = _hash(model.encode(), scope)
    explicit = prompt.prompt_cache_key if prompt is not None else None
    if not isinstance(explicit, str) or not explicit:
        explicit = session or None
    key = _hash(explicit[:MAX_KEY_CHARS].encode(), seed) if explicit else None
    if prompt is None:
        return None if key is None else Affinity(key, [], seed)
    head = [p for p in (prompt.system, prompt.instructions, prompt.tools) if p]
    body = prompt.messages or prompt.input or prompt.prompt
    if key is None and not head and not body:
        return None
    # The parts are hashed in order without being joined (no copy of the prompt): each
    # leading part is cut into blocks, its last one short; the body into full blocks
    # only, since its tail grows with every turn.
    blocks: list[int] = []
    size = config.block_bytes
    room = config.max_prompt_blocks
    h = seed
    for part in head:
        view = memoryview(part)
        for start in range(0, min(len(view), room * size), size):
            h = _hash(view[start : start + size], h)
            blocks.append(h)
        room = config.max_prompt_blocks - len(blocks)
    view = memoryview(body)
    for start in range(0, min(len(view) // size, room) * size, size):
        h = _hash(view[start : start + size], h)
        blocks.append(h)
    return Affinity(key, blocks, seed, (head, body))


def _first_turn(body: msgspec.Raw) -> bytes:
    """The messages up to and including the first that is not a system message (a
    message list), or the body itself (a string prompt: its first 1 KiB)."""
    raw = bytes(body)
    if not raw.startswith(b"["):
        return raw[:1024]
    try:
        items = _messages_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw[:1024]
    for i, item in enumerate(items):
        try:
            role = _role_decoder.decode(item).role
        except (msgspec.DecodeError, RecursionError):
            role = None
        if role not in ("system", "developer"):
            return _SEP.join(bytes(m) for m in items[: i + 1])
    return raw


class _Counts:
    __slots__ = ("confirmed", "predicted_tokens", "refuted", "reported_tokens")

    def __init__(self) -> None:
        self.predicted_tokens = 0
        self.reported_tokens = 0
        self.confirmed = 0
        self.refuted = 0


class Router:
    """The index and the choice; one per relay (see the module docstring)."""

    def __init__(self, config: AffinityConfig) -> None:
        self.config = config
        #: worker id -> its blocks, least recently sent first.
        self._held: OrderedDict[str, OrderedDict[int, None]] = OrderedDict()
        #: explicit key -> worker id, least recently used first.
        self._keys: OrderedDict[int, str] = OrderedDict()
        self.decisions: Counter[str] = Counter()
        #: worker name -> predicted/reported cached tokens and confirmed/refuted hits.
        self.by_worker: dict[str, _Counts] = {}

    @property
    def enabled(self) -> bool:
        """Whether requests get an affinity: the cache decides (``cache_aware``) or is
        one input of the prediction (``predicted``)."""
        return self.config.policy != "least_load"

    @property
    def predicts(self) -> bool:
        """Whether the prediction chooses the worker (SPEC §21)."""
        return self.config.policy == "predicted"

    def affinity(
        self, prompt: Prompt | None, model: str, session: str | None, key_id: int | None
    ) -> Affinity | None:
        """A request's affinity, in the scope of its API key (see the module docstring)."""
        if not self.enabled:
            return None
        return affinity_of(prompt, model, session, key_id, self.config)

    # -- choosing ---------------------------------------------------------------------

    def depth(self, worker_id: str, blocks: list[int]) -> int:
        """How many leading ``blocks`` the worker holds (its blocks of one chain are a
        prefix, so a binary search finds the end)."""
        held = self._held.get(worker_id)
        if not held or not blocks or blocks[0] not in held:
            return 0
        lo, hi = 1, len(blocks)  # blocks[:lo] held; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def bound(self, workers: Sequence[Worker]) -> int:
        """The most load a worker may have after taking one more request for its cache:
        ``factor`` times the mean, or ``slack`` more than the least loaded worker, the
        larger (a multiplicative bound alone is strict at small loads: with four
        requests running on one worker and one on the other, ceil(1.25 x 6 / 2) = 4
        would move the busier one's next turn, and its whole prefix, for a difference
        of three requests)."""
        total = 1
        least = workers[0].load
        for w in workers:
            load = w.load
            total += load
            if load < least:
                least = load
        config = self.config
        return max(
            math.ceil(config.load_factor * total / len(workers)), least + 1 + config.load_slack
        )

    def choose(self, request: RelayRequest, workers: Sequence[W]) -> W | None:
        """The worker ``request`` should go to among ``workers`` (all can take it now),
        or None: least-load decides. Records the decision on the request."""
        affinity: Affinity | None = request.affinity
        if affinity is None or not workers:
            return None
        bound = self.bound(workers)
        guarded = False
        if affinity.key is not None:
            owner = self._keys.get(affinity.key)
            if owner is not None:
                for worker in workers:
                    if worker.id == owner:
                        if worker.load + 1 <= bound:
                            affinity.decision = "hit"
                            return worker
                        guarded = True
                        break
        best: W | None = None
        best_depth = 0
        if affinity.blocks:
            # A match that covers less than min_match of the prompt does not decide.
            floor = self.config.min_match * affinity.size
            for worker in workers:
                depth = self.depth(worker.id, affinity.blocks)
                if depth == 0 or affinity.covered(depth, self.config.block_bytes) < floor:
                    continue
                if worker.load + 1 > bound:
                    guarded = True
                    continue
                if depth > best_depth or (
                    depth == best_depth and best is not None and worker.load < best.load
                ):
                    best, best_depth = worker, depth
        affinity.decision = "hit" if best is not None else "guard" if guarded else "miss"
        return best

    # -- what happened ----------------------------------------------------------------

    def assigned(self, request: RelayRequest, worker: Worker) -> None:
        """``request`` was sent to ``worker`` (by any path): count the decision, note the
        prediction, and remember that the worker now holds its prefix."""
        affinity: Affinity | None = request.affinity
        if affinity is None:
            return
        affinity.predicted = self.depth(worker.id, affinity.blocks)
        if not affinity.decision:  # fed from the queue, or placed by the cluster
            affinity.decision = "hit" if affinity.predicted else "miss"
        self.decisions[affinity.decision] += 1
        affinity.sent()
        self._remember(worker.id, affinity)

    def _remember(self, worker_id: str, affinity: Affinity) -> None:
        if affinity.key is not None:
            keys = self._keys
            keys[affinity.key] = worker_id
            keys.move_to_end(affinity.key)
            while len(keys) > self.config.max_keys:
                keys.popitem(last=False)
        if not affinity.blocks:
            return
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = OrderedDict()
            while len(self._held) > self.config.max_workers:
                self._held.popitem(last=False)
        else:
            self._held.move_to_end(worker_id)
        # Deepest first, so the LRU evicts a chain from its end and keeps a prefix.
        for block in reversed(affinity.blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        excess = len(held) - self.config.worker_blocks
        for _ in range(excess):
            held.popitem(last=False)

    def completed(self, request: RelayRequest, worker: Worker, counts: TokenCounts | None) -> None:
        """The backend answered: count what it says it reused (under either policy) and
        compare it with the prediction."""
        reported = counts.cached_tokens if counts is not None else None
        affinity: Affinity | None = request.affinity
        if reported is None and affinity is None:
            return
        row = self._counts(worker.name)
        if reported is not None:
            row.reported_tokens += reported
        if affinity is None or not affinity.predicted:
            return
        row.predicted_tokens += affinity.predicted * self.config.block_bytes // BYTES_PER_TOKEN
        if reported is None:
            return
        if reported > 0:
            row.confirmed += 1
            return
        row.refuted += 1
        held = self._held.get(worker.id)
        if held is not None:
            for block in affinity.blocks[: affinity.predicted]:
                held.pop(block, None)

    def _counts(self, name: str) -> _Counts:
        row = self.by_worker.get(name)
        if row is None:
            if len(self.by_worker) >= MAX_WORKER_LABELS:
                name = "(other)"
                row = self.by_worker.get(name)
            if row is None:
                row = self.by_worker[name] = _Counts()
        return row

    def forget_worker(self, worker_id: str) -> None:
        """The worker left: its blocks go at once. Keys that named it match nothing
        any more (worker ids are never reused) and are named anew or age out."""
        self._held.pop(worker_id, None)

    # -- reading ----------------------------------------------------------------------

    def blocks_of(self, worker_id: str) -> int:
        held = self._held.get(worker_id)
        return len(held) if held is not None else 0

    def entries(self) -> int:
        """Blocks and keys remembered in all (what the memory bound bounds)."""
        return sum(len(h) for h in self._held.values()) + len(self._keys)

    def describe(self) -> dict[str, Any]:
        """For ``/admin/stats`` and the dashboard."""
        confirmed = sum(r.confirmed for r in self.by_worker.values())
        refuted = sum(r.refuted for r in self.by_worker.values())
        return {
            "policy": self.config.policy,
            "guard": {"load_factor": self.config.load_factor, "load_slack": self.config.load_slack},
            "min_match": self.config.min_match,
            "share_across_keys": self.config.share_across_keys,
            "decisions": {d: self.decisions[d] for d in DECISIONS},
            "predicted_hits_confirmed": confirmed,
            "predicted_hits_refuted": refuted,
            "blocks": sum(len(h) for h in self._held.values()),
            "blocks_by_worker": {wid: len(h) for wid, h in self._held.items()},
            "keys": len(self._keys),
            "workers": {
                name: {
                    "predicted_cached_tokens": row.predicted_tokens,
                    "reported_cached_tokens": row.reported_tokens,
                    "confirmed": row.confirmed,
                    "refuted": row.refuted,
                }
                for name, row in sorted(self.by_worker.items())
            },
        }
