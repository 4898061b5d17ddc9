"""The batch engine: runs the lines of running batches on capacity nobody else wants.

One engine per server process, started and stopped by the runtime. On a loop it
validates new batches, claims lines (for models with a free slot: a line never
waits in the shared queue in front of someone's interactive request), hands each to
the relay core exactly as a client request of the batch's key (``relay.submit``,
with the key's admission ticket, service class ``flex``, never streamed), and writes
how each ended. When a request finishes anywhere, the next claimed line starts on
the slot it freed at once; everything that touches the database runs in the
engine's own thread, never on the event loop.

A line whose worker fails (a 502/503/504, a lost worker, a worker error) is tried
again up to MAX_REQUEUE_COUNT times, then written with its last error. Lines refused
for the moment (the key's limits, a full queue) wait and are tried again. Lines of a
batch that was cancelled or whose window ended are stopped where they run.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from typing import Any

from batches.models import ACTIVE, IN_PROGRESS, LINE_EXPIRED
from relay.core.relay import Relay
from relay.core.stats import RequestRecord
from relay.server.batches import claims, lifecycle
from relay.server.batches.capacity import claimable_models, free_slots, startable
from relay.server.batches.checker import CHECKER, clean_scratch
from relay.server.batches.claims import Claimed, Result
from relay.server.batches.config import BatchSettings, flavor
from relay.server.batches.db import DatabaseThread
from relay.server.batches.execute import Host, Retry, Running, execute
from relay.server.batches.lifecycle import ended_as

logger = logging.getLogger("relay.batches")

#: Results written in one transaction at most (more wait for the next flush).
FLUSH_LINES = 500
#: How often batches past the retention are pruned.
PRUNE_EVERY = 3600.0
#: The longest pause between two restarts of the engine's loop after an error.
MAX_BACKOFF = 30.0
#: Cluster mode: lines claimed at once (they start one placement at a time).
CLUSTER_CLAIM = 16
#: A claimed line that found no free slot for this many polls is handed back.
STALE_POLLS = 10


class BatchEngine:
    def __init__(self, rt: Host, config: BatchSettings | None = None) -> None:
        self.rt = rt
        self.relay: Relay = rt.relay
        #: Re-read from settings at every poll unless given (then fixed).
        self.config = config or BatchSettings.from_settings()
        self._fixed = config is not None
        self.loop = rt.loop
        self.db = DatabaseThread()
        #: Where inputs are checked (the engine's validations, Message Batches' creations).
        self.checker = CHECKER
        #: Claimed lines waiting for a free slot, and lines running, by line id.
        self.ready: list[Claimed] = []
        self.running: dict[int, Running] = {}
        self.results: list[Result] = []
        self.stopping = False
        #: Counted here: lines written by outcome, attempts tried again.
        self.finished: Counter[str] = Counter()
        self.retries = 0
        #: As of the last poll (every process's): batches with work left and the last
        #: few ended, and their lines that have not ended.
        self.batches: list[dict[str, Any]] = []
        self.waiting = 0
        self._first_result = 0.0
        self._wake = asyncio.Event()
        self._soon = False
        self._turn = 0
        self._next_poll = 0.0
        self._next_renew = 0.0
        self._next_prune = 0.0
        #: No claimable line was found: none is looked for again before this.
        self._claims_after = 0.0
        #: Keys over one of their limits -> loop time until which none of their
        #: lines is claimed or started.
        self.paused: dict[int, float] = {}
        #: The pause before the loop runs again after a failed step (doubles while
        #: steps fail, back to BATCH_POLL_SECS after a poll that went through).
        self._backoff = self.config.poll

    # ------------------------------------------------------------------ hooks

    def observe(self, record: RequestRecord) -> None:
        """Request observer: a slot may have freed. The next line starts once the core
        has handed that slot to whoever waited for it (hence ``call_soon``)."""
        if self.waiting <= 0 and not self.ready:
            return
        if self.ready and not self._soon:
            self._soon = True
            self.loop.call_soon(self._start_ready)
        self._wake.set()

    def poke(self) -> None:
        """Something changed (a batch was created or cancelled here): look now."""
        self._next_poll = 0.0
        self._claims_after = 0.0
        self._wake.set()

    def counts(self) -> dict[str, Any]:
        """What ``/metrics`` shows."""
        by_status: Counter[str] = Counter(
            b["status"] for b in self.batches if b["status"] in ACTIVE
        )
        return {
            "waiting": self.waiting,
            "claimed": len(self.ready),
            "running": len(self.running),
            "finished": dict(self.finished),
            "retries": self.retries,
            "batches": dict(by_status),
        }

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """The engine's task (owned by the runtime): restarted with backoff when a
        step fails; on cancellation it hands back every line it holds."""
        try:
            await self.db.run(clean_scratch)  # what a killed process left
            await self.rt.ready()  # providers and keys read: lines can be judged
            while True:
                try:
                    await self._loop()
                    return
                except Exception:
                    backoff = self._backoff
                    logger.exception("batch engine step failed; again in %.1f s", backoff)
                    self._backoff = min(backoff * 2, MAX_BACKOFF)
                    await asyncio.sleep(backoff)
        finally:
            await self._wind_down()

    async def _loop(self) -> None:
        while not self.stopping:
            now = self.loop.time()
            if now >= self._next_poll:
                self._next_poll = now + self.config.poll
                await self._poll()
            await self._flush(force=False)
            await self._claim()
            self._start_ready()
            now = self.loop.time()
            timeout = self._next_poll - now
            if self.results:
                timeout = min(timeout, self._first_result + self.config.flush - now)
            if timeout > 0:
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()

    async def _poll(self) -> None:
        if not self._fixed:
            self.config = BatchSettings.from_settings()
        config = self.config
        limits = lifecycle.Limits(
            max_lines=config.max_lines,
            max_model_len=self.relay.config.max_model_name_len,
            max_queued=config.max_queued,
            lease_secs=max(config.claim, 1.0),
            max_request_bytes=self.relay.config.max_request_bytes,
        )
        for _ in range(8):
            # Read for each batch, as late as possible: a worker that registered a moment
            # ago (the relay just started) must not have its models judged unknown.
            known = frozenset(self.relay.routable_models())
            name = await self.db.run(
                lifecycle.validate_next, self._token(), known, limits, self.checker
            )
            if name is None:
                break
            logger.info("batch %s validated", name)
        held = {r.line.batch_id for r in self.running.values()}
        held.update(line.batch_id for line in self.ready)
        if held:
            self._stop_ended(await self.db.run(lifecycle.states, held))
        now = self.loop.time()
        self._hand_back_stale(now)
        if now >= self._next_renew:
            self._next_renew = now + config.claim / 3
            tokens = {r.line.token for r in self.running.values()}
            tokens.update(line.token for line in self.ready)
            await self.db.run(claims.renew, tokens, config.claim)
        await self._flush(force=True)
        for name in await self.db.run(lifecycle.sweep):
            logger.info("batch %s ended", name)
        self.batches = await self.db.run(lifecycle.overview)
        self.waiting = sum(
            b["total"] - b["succeeded"] - b["errored"] - b["canceled"] - b["expired"]
            for b in self.batches
            if b["status"] == IN_PROGRESS
        )
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY
            pruned = await self.db.run(lifecycle.prune, config.retention_days)
            if pruned:
                logger.info("pruned %d batch(es) past BATCH_RETENTION_DAYS", pruned)
        self._backoff = config.poll

    def _stop_ended(self, states: dict[int, tuple[str, float]]) -> None:
        """Stop the lines of batches that were cancelled or ran out of time."""
        now = time.time()
        for line in list(self.ready):
            outcome = ended_as(states.get(line.batch_id), now)
            if outcome:
                self.ready.remove(line)
                self._write(Result(line.line_id, line.token, line.batch_id, line.failures, outcome))
        for run in list(self.running.values()):
            outcome = ended_as(states.get(run.line.batch_id), now)
            if outcome and not run.ended:
                run.ended = outcome
                if run.request is not None:
                    self.relay.cancel(
                        run.request, "timeout" if outcome == LINE_EXPIRED else "client_disconnect"
                    )

    def _hand_back_stale(self, now: float) -> None:
        """Claimed lines that found no free slot for STALE_POLLS polls (their model's
        workers left, or others took every slot) go back for anyone to claim."""
        limit = STALE_POLLS * self.config.poll
        for line in [x for x in self.ready if now - x.since > limit and x.not_before <= now]:
            self.ready.remove(line)
            self._write(Result(line.line_id, line.token, line.batch_id, line.failures))

    # ------------------------------------------------------------------ claiming

    def _shared_queue_depth(self) -> int | None:
        """Cluster mode: the shared queue's depth as last seen (None: one process)."""
        if not self.relay.clustered:
            return None
        placement = self.rt.placement
        return placement.queue_depth if placement is not None else 0

    async def _claim(self) -> None:
        if self.stopping or self.relay.shutting_down or self.waiting <= 0:
            return
        now = self.loop.time()
        room = self.config.max_in_flight - len(self.running) - len(self.ready)
        if room <= 0 or now < self._claims_after:
            return
        depth = self._shared_queue_depth()
        spare = self.config.spare
        models = claimable_models(self.relay, depth, spare)
        if not models:
            return
        if depth is None:  # as many as there are free slots, and as many again
            free = sum(free_slots(self.relay, model) - spare for model in models)
            room = min(room, 2 * free)
        else:
            room = min(room, CLUSTER_CLAIM)
        self._turn += 1
        self.paused = {key: until for key, until in self.paused.items() if until > now}
        lines = await self.db.run(
            claims.claim,
            self._token(),
            models,
            room,
            self.config.claim,
            self._turn,
            list(self.paused),
        )
        if not lines:
            self._claims_after = self._next_poll  # nothing to take: look at the next poll
        for line in lines:
            line.since = now
        self.ready.extend(lines)

    def _token(self) -> str:
        return f"{self.relay.instance}-{secrets.token_hex(8)}"

    # ------------------------------------------------------------------ running

    def _start_ready(self) -> None:
        """Start claimed lines on the free slots of their models (never more)."""
        self._soon = False
        if self.stopping or self.relay.shutting_down or not self.ready:
            return
        for line in startable(
            self.relay,
            self.ready,
            list(self.running.values()),
            now=self.loop.time(),
            room=self.config.max_in_flight - len(self.running),
            shared_queue_depth=self._shared_queue_depth(),
            key_cap=self._key_cap,
            spare=self.config.spare,
        ):
            self.ready.remove(line)
            run = Running(line)
            self.running[line.line_id] = run
            run.task = self.loop.create_task(self._run(run))

    def _key_cap(self, key_id: int) -> int | None:
        """How many lines of the key may run here at once: none while it is paused,
        else its max_concurrent (its admission would refuse one more)."""
        if not self.rt.require_keys:
            return None
        if self.paused.get(key_id, 0.0) > self.loop.time():
            return 0
        return self.rt.key_limits(key_id).max_concurrent

    async def _run(self, run: Running) -> None:
        line = run.line
        outcome: Result | Retry | None = None
        try:
            outcome = await execute(
                self.rt,
                run,
                flavor(line.endpoint),
                retry_delay=self.config.poll,
            )
        except asyncio.CancelledError:
            raise  # stopping: the line is handed back by _wind_down
        except Exception:
            logger.exception("batch line %s failed unexpectedly; it is tried again", line.line_id)
            outcome = Retry(self.config.poll, spend=False)
        finally:
            self.running.pop(line.line_id, None)
            if isinstance(outcome, Retry):
                self.retries += 1
                line.failures += 1 if outcome.spend else 0
                line.since = self.loop.time()
                line.not_before = line.since + outcome.delay
                if outcome.pause_key and line.key_id is not None:
                    self._pause(line, outcome.delay)
                else:
                    self.ready.insert(0, line)
            elif outcome is not None:
                self._write(outcome)
            if outcome is not None:
                self._start_ready()
                self._wake.set()

    def _pause(self, line: Claimed, delay: float) -> None:
        """The line's key is over a limit: hand its lines back, claim none for ``delay``."""
        key_id = line.key_id
        assert key_id is not None
        self.paused[key_id] = self.loop.time() + delay
        for held in [line, *(other for other in self.ready if other.key_id == key_id)]:
            if held is not line:
                self.ready.remove(held)
            self._write(Result(held.line_id, held.token, held.batch_id, held.failures))

    # ------------------------------------------------------------------ writing

    def _write(self, result: Result) -> None:
        if not self.results:
            self._first_result = self.loop.time()
        self.results.append(result)
        if result.outcome:
            self.finished[result.outcome] += 1
        if len(self.results) >= FLUSH_LINES:
            self._wake.set()

    async def _flush(self, *, force: bool) -> None:
        if not self.results:
            return
        due = self.loop.time() - self._first_result >= self.config.flush
        if not force and not due and len(self.results) < FLUSH_LINES:
            return
        batch, self.results = self.results[:FLUSH_LINES], self.results[FLUSH_LINES:]
        try:
            await self.db.run(claims.record, batch)
        except BaseException:
            self.results = batch + self.results  # written next time (claims permitting)
            raise
        if self.results:
            self._first_result = self.loop.time()

    async def _wind_down(self) -> None:
        """Stop every line, hand back what did not end (another process, or this one
        after a restart, runs it), write what did. Bounded: a database that does not
        answer leaves the claims to lapse."""
        self.stopping = True
        tasks = [run.task for run in self.running.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for run in self.running.values():
            line = run.line
            self.results.append(Result(line.line_id, line.token, line.batch_id, line.failures))
        for line in self.ready:
            self.results.append(Result(line.line_id, line.token, line.batch_id, line.failures))
        self.running.clear()
        self.ready.clear()
        try:
            async with asyncio.timeout(5):
                while self.results:
                    await self._flush(force=True)
        except Exception:
            logger.warning("batch results not written at shutdown; their claims will lapse")
        finally:
            await self.db.aclose()

    async def stop(self) -> None:
        """Graceful stop (server shutdown): no new lines; running ones are handed back."""
        self.stopping = True
        self._wake.set()
