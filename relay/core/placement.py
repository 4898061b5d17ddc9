"""Where requests go when several server processes share one worker pool (SPEC §11).

The dispatcher alone places requests on the workers connected to its own process. With
a :class:`Placement` plugged in (``relay.server.cluster.placement`` backs it with Redis), the
choice becomes cluster-wide: capacity is reserved in one shared place, requests that
find none wait in one shared queue per provider, and a slot that frees anywhere goes to
the compatible request whose turn it is anywhere (the fair order of
:mod:`relay.core.fairqueue`). The dispatcher still owns every request it
admitted (its deadlines, cancellation, requeue) and every worker connected to it; the
placement only decides *which* worker, and tells the dispatcher through
:meth:`relay.core.dispatch.Dispatcher.assign_to`.

Every method is called on the event loop and returns at once; the work behind it
(Redis round trips, messages to other processes) runs in tasks the placement owns.
While :attr:`Placement.active` is False (Redis unreachable) the dispatcher places
requests locally, as a single process does.
"""

from __future__ import annotations

from typing import Protocol

from relay.core.state import RelayRequest, Worker


class Placement(Protocol):
    @property
    def active(self) -> bool:
        """True while the shared state can be used; False: place locally."""

    def place(self, request: RelayRequest) -> None:
        """``request`` (queued here, with its provider and model resolved) needs a slot:
        reserve one anywhere, or add it to the shared queue."""

    def predict(self, request: RelayRequest) -> float | None:
        """Speed-aware routing (SPEC §21): ``request``'s lowest predicted time to first
        token on the workers of the other processes, from the speeds and loads they
        share (as of their last report; never waits on Redis); None: none known."""

    def withdraw(self, request: RelayRequest) -> None:
        """A request that was waiting ended here (cancel, timeout): drop its entry."""

    def freed(self, worker: Worker, lease: str | None) -> None:
        """A local worker's slot opened (the request that held reservation ``lease``
        left it): give it to the compatible request whose turn it is, anywhere. Called
        whether the placement is active or not: an inactive one releases the lease once
        it can."""

    def worker_changed(self, worker: Worker) -> None:
        """A local worker registered, or its models or drain state changed."""

    def worker_gone(self, worker: Worker) -> None:
        """A local worker left: its capacity is no longer offered."""

    def want_model(self, provider: str, model: str, *, scale: bool = False) -> None:
        """Models on demand (SPEC §19): requests here wait for ``model``, loaded nowhere
        (``scale``: loaded, but its queue keeps waiting). Have it loaded once, on the
        worker of any process the cluster chooses; that process is told (see
        :meth:`relay.core.residency.Residency.cluster_load`)."""

    def load_done(self, provider: str, model: str, worker_id: str, ok: bool) -> None:
        """A load the cluster chose a local worker for ended (``ok``: it is loaded)."""

    def unload_if_unwanted(self, worker: Worker, model: str) -> None:
        """``model`` sat idle on a local worker: unload it unless requests for it wait
        anywhere in the cluster."""
