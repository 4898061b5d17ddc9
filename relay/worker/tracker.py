"""The worker's view of its backend's models, kept current (SPEC §19, the
``model_states`` extension).

``worker.Worker`` holds one :class:`ModelTracker` for the life of the process, around the
:class:`~relay.worker.modelhost.ModelHost` recognised at start-up, and runs its
:meth:`ModelTracker.run`: the backend's event stream where it has one, a poll of its
states otherwise, and a poll behind the events anyway, since a stream can drop. Every
connection's :class:`relay.worker.announcer.ModelAnnouncer` reports the states from it;
:class:`relay.worker.operations.ModelOperations` loads and unloads through it. Imports
nothing from Django.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from itertools import islice

from relay.wire.protocol import (
    LOADABLE,
    LOADED,
    LOADING,
    MAX_MODEL_STATES,
    ModelState,
    ModelStates,
)
from relay.worker.backend import BackendNotReady
from relay.worker.config import Config
from relay.worker.modelhost import Model, ModelHost, Snapshot

log = logging.getLogger("modelrelay.worker")

#: Changes logged one line per model; more at once are counted in one line.
MAX_LOGGED_CHANGES = 20
#: Delay before an event stream that failed is opened again, doubling up to the poll
#: behind it.
WATCH_RETRY_SECS = 0.5


class ModelTracker:
    """Each model's state as the worker reports it.

    ``on_change(snapshot, names_changed)`` is called after every change of what the
    relay is told (a state, a model's slots, the capacity, the set of names);
    ``on_unreachable(problem)`` when the backend refused a connection.
    """

    def __init__(
        self,
        host: ModelHost,
        config: Config,
        on_change: Callable[[Snapshot, bool], None],
        on_unreachable: Callable[[str], None],
    ) -> None:
        self.host = host
        self.config = config
        self._on_change = on_change
        self._on_unreachable = on_unreachable
        #: What the backend said last.
        self._raw = Snapshot({}, host.capacity)
        #: What the relay is told: the backend's word, except that a model this worker
        #: is loading shows ``loading`` while the backend does not say so itself.
        self.snapshot = self._raw
        #: Bumped at every change of ``snapshot`` (and by :meth:`touch`).
        self.version = 0
        self._version_changed = asyncio.Event()
        #: Reads of the states begun, and how the last one failed (None: it did not).
        self._reads = 0
        self._failure: BackendNotReady | None = None
        self._read_lock = asyncio.Lock()
        #: Set (and replaced) at every answer of the backend, changed or not.
        self._answered = asyncio.Event()
        self._poked = asyncio.Event()
        self._loading: set[str] = set()
        self._truncated = False
        self._seen = False
        self._interval = config.model_refresh_secs if host.has_events else config.model_poll_secs

    @property
    def on_demand(self) -> bool:
        return self.host.on_demand

    # -- what the relay is told --------------------------------------------------------

    def frame(self) -> ModelStates:
        """The whole list now, as one ``model_states`` frame."""
        return ModelStates(states=self.states(), model_capacity=self.snapshot.capacity)

    def states(self) -> list[ModelState]:
        return [
            ModelState(model=n, state=m.state, slots=m.slots)
            for n, m in self.snapshot.models.items()
        ]

    def names(self) -> list[str]:
        return list(self.snapshot.models)

    def loaded_slots(self) -> int:
        """The slots of the models in memory, where the backend tells them (else 0)."""
        return sum(m.slots or 0 for m in self.snapshot.models.values() if m.state == LOADED)

    async def changed(self, since: int) -> None:
        """Return once :attr:`version` passed ``since``."""
        while self.version <= since:
            await self._version_changed.wait()

    def touch(self) -> None:
        """Have every connection send the whole list again (the backend is back)."""
        self._bump()

    def poke(self) -> None:
        """Something changed at the backend: read the states again soon."""
        self._poked.set()

    # -- reading the backend -----------------------------------------------------------

    async def refresh(self) -> Snapshot:
        """Read the states now, or share a read that began after this call.

        Raises :class:`BackendNotReady` when the backend did not answer.
        """
        asked = self._reads
        async with self._read_lock:
            if self._reads > asked:  # one began after this call, and has ended
                if self._failure is not None:
                    raise BackendNotReady(str(self._failure), unreachable=self._failure.unreachable)
                return self.snapshot
            self._reads += 1
            try:
                raw = await self.host.states()
            except BackendNotReady as exc:
                self._failure = exc
                raise
            self._failure = None
            self._apply(raw)
            return self.snapshot

    def _apply(self, raw: Snapshot) -> None:
        if len(raw.models) > MAX_MODEL_STATES:
            log.log(
                logging.DEBUG if self._truncated else logging.WARNING,
                "the backend lists %d models; reporting the first %d",
                len(raw.models),
                MAX_MODEL_STATES,
            )
            self._truncated = True
            raw = Snapshot(dict(islice(raw.models.items(), MAX_MODEL_STATES)), raw.capacity)
        self._raw = raw
        models = dict(raw.models)
        for name in self._loading:
            if name in models and models[name].state == LOADABLE:
                models[name] = Model(LOADING)
        view = Snapshot(models, raw.capacity)
        before, self.snapshot = self.snapshot, view
        self._answered.set()
        self._answered = asyncio.Event()
        first, self._seen = not self._seen, True
        if view == before:
            return
        if not first:  # the first list is the worker's start-up line
            _log_changes(before, view)
        self._bump()
        self._on_change(view, not first and list(view.models) != list(before.models))

    def _bump(self) -> None:
        self.version += 1
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    # -- keeping it current --------------------------------------------------------------

    async def run(self) -> None:
        """Keep the states current until cancelled (the worker owns this task).

        Reads them again at each notice of the backend's event stream, and every
        ``--model-refresh-secs`` behind it; every ``--model-poll-secs`` for a backend
        without one, and while its stream cannot be opened. A read that fails is tried
        again at the next turn; a backend that refuses connections is reported (the
        worker withdraws its models meanwhile).
        """
        watcher = (
            asyncio.create_task(self._watch(), name="model events")
            if self.host.has_events
            else None
        )
        try:
            while True:
                try:
                    async with asyncio.timeout(self._interval):
                        await self._poked.wait()
                except TimeoutError:
                    pass
                self._poked.clear()
                await self._read_quietly()
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.wait([watcher])

    async def _read_quietly(self) -> None:
        try:
            await self.refresh()
        except BackendNotReady as exc:
            if exc.unreachable:
                self._on_unreachable(str(exc))
            else:
                log.debug("reading the model states failed (%s); trying again", exc)
        except Exception:  # a bug must not stop the states from being kept
            log.exception("reading the model states failed unexpectedly")

    async def _watch(self) -> None:
        """Follow the backend's event stream; poll while it is down, and for good if the
        backend has none."""
        delay = WATCH_RETRY_SECS
        while True:
            try:
                ongoing = await self.host.watch(self._event, self.config.model_refresh_secs)
            except BackendNotReady as exc:
                self._interval = self.config.model_poll_secs  # until an event comes again
                log.debug("the backend's model events: %s; opening them again in %gs", exc, delay)
            except Exception:
                self._interval = self.config.model_poll_secs
                log.exception("following the backend's model events failed unexpectedly")
            else:
                if not ongoing:
                    log.info("the backend has no model event stream: polling its model states")
                    self._interval = self.config.model_poll_secs
                    self.poke()
                    return
                delay = WATCH_RETRY_SECS
                self.poke()
                continue
            self.poke()
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.model_refresh_secs)

    def _event(self) -> None:
        """A notice from the backend's event stream: it is up, the poll behind it slow."""
        self._interval = self.config.model_refresh_secs
        self.poke()

    # -- what operations need ------------------------------------------------------------

    def backend_state(self, model: str) -> str:
        """``model``'s state as the backend said it last ("" when it has no such model)."""
        found = self._raw.models.get(model)
        return "" if found is None else found.state

    def problem(self, model: str) -> str | None:
        """Why the backend says ``model``'s last load failed, where it says."""
        found = self._raw.models.get(model)
        return None if found is None else found.problem

    def state(self, model: str) -> str:
        """``model``'s state as the relay is told it ("" when there is no such model)."""
        found = self.snapshot.models.get(model)
        return "" if found is None else found.state

    @property
    def answered(self) -> asyncio.Event:
        """Set at the backend's next answer to a read of the states, changed or not."""
        return self._answered

    def loading(self, model: str, on: bool) -> None:
        """While on, ``model`` shows ``loading`` where the backend says ``loadable``: this
        worker is loading it and the backend does not say so itself (Ollama)."""
        if on:
            self._loading.add(model)
        else:
            self._loading.discard(model)
        self._apply(self._raw)


def _log_changes(before: Snapshot, after: Snapshot) -> None:
    """One line per model whose state changed (a count past :data:`MAX_LOGGED_CHANGES`)."""
    changed = [
        (name, model.state, before.models[name].state if name in before.models else None)
        for name, model in after.models.items()
        if name not in before.models or before.models[name].state != model.state
    ]
    gone = [name for name in before.models if name not in after.models]
    if len(changed) + len(gone) > MAX_LOGGED_CHANGES:
        log.info("%d models changed state, %d left the backend", len(changed), len(gone))
        return
    for name, state, old in changed:
        log.info("model %s: %s", name, state if old is None else f"{old} -> {state}")
    for name in gone:
        log.info("model %s: no longer on the backend", name)
