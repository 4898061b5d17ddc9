"""A raw worker that speaks the ``model_states`` extension (models on demand, SPEC §19).

It plays a box whose backend holds more models than memory: it registers each model's
state and its model slots, answers every ``model_load`` / ``model_unload`` as a backend
would (the new state in a ``model_states`` frame, then the ``model_result``), evicting
nothing by itself, and answers every request at once for a model it has loaded — and
with a 400 "model is not loaded" for one it has not, as llama-server's router does
without autoload, so a test sees any request routed to the wrong box.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from websockets.exceptions import ConnectionClosed

from relay.wire import protocol
from relay.wire.protocol import LOADABLE, LOADED
from tests.live import LiveServer
from tests.rawworker import connect
from tests.scriptedworker import completion


class StatesWorker:
    def __init__(
        self,
        server: LiveServer,
        states: dict[str, str],
        *,
        capacity: int | None = None,
        max_concurrent: int = 4,
        name: str = "box",
        answer_loads: bool = True,
        fail_loads: bool = False,
        hold_loads: bool = False,
    ) -> None:
        self.server = server
        self.states = dict(states)
        self.capacity = capacity
        self.max_concurrent = max_concurrent
        self.name = name
        #: False: loads are received and never answered (a load that hangs).
        self.answer_loads = answer_loads
        self.fail_loads = fail_loads
        #: Set: loads wait until :meth:`finish_loads` (a load that takes a while).
        self._loads_go = asyncio.Event()
        if not hold_loads:
            self._loads_go.set()
        #: Every operation received, in order: ("load" | "unload", model).
        self.ops: list[tuple[str, str]] = []
        #: Requests served, by model; and requests for a model it did not have loaded.
        self.served: list[str] = []
        self.misrouted: list[str] = []
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    async def __aenter__(self) -> StatesWorker:
        self._ws = await connect(self.server)
        await self._send(
            protocol.Register(
                worker_name=self.name,
                models=list(self.states),
                max_concurrent=self.max_concurrent,
                protocol_version="1",
                features=[protocol.MODEL_STATES],
                model_states=self._listed(),
                model_capacity=self.capacity,
            )
        )
        ack = protocol.decode_server_message(await self._ws.recv())
        assert isinstance(ack, protocol.RegisterAck), ack
        assert protocol.MODEL_STATES in ack.features
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._reader is not None and self._ws is not None
        for task in [self._reader, *self._tasks]:
            task.cancel()
        await asyncio.gather(self._reader, *self._tasks, return_exceptions=True)
        await self._ws.close()

    def finish_loads(self) -> None:
        """Loads held back (``hold_loads``) complete now."""
        self._loads_go.set()

    def _listed(self) -> list[protocol.ModelState]:
        return [protocol.ModelState(model=m, state=s) for m, s in self.states.items()]

    async def _send(self, message: protocol.WorkerMessage) -> None:
        assert self._ws is not None
        await self._ws.send(protocol.encode(message))

    async def set_state(self, model: str, state: str) -> None:
        """The backend changed a state by itself (another client, an operator)."""
        self.states[model] = state
        await self._send(protocol.ModelStates(states=self._listed()))

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            while True:
                message = protocol.decode_server_message(await self._ws.recv())
                match message:
                    case protocol.Ping():
                        await self._send(protocol.Pong(current_load=0))
                    case protocol.ModelLoad() | protocol.ModelUnload():
                        self._tasks.add(asyncio.ensure_future(self._operate(message)))
                    case protocol.Request():
                        await self._serve(message)
        except ConnectionClosed:
            return

    async def _operate(self, message: protocol.ModelLoad | protocol.ModelUnload) -> None:
        load = isinstance(message, protocol.ModelLoad)
        self.ops.append(("load" if load else "unload", message.model))
        if load and not self.answer_loads:
            return
        if load:
            await self._loads_go.wait()
        ok = not (load and self.fail_loads)
        if ok:
            self.states[message.model] = LOADED if load else LOADABLE
            await self._send(protocol.ModelStates(states=self._listed()))
        await self._send(
            protocol.ModelResult(
                op_id=message.op_id,
                model=message.model,
                op="load" if load else "unload",
                ok=ok,
                state=self.states[message.model],
                error=None if ok else "out of memory",
                duration_ms=1,
            )
        )

    async def _serve(self, request: protocol.Request) -> None:
        if self.states.get(request.model) != LOADED:
            self.misrouted.append(request.model)
            status, body = 400, '{"error":{"message":"model is not loaded"}}'
        else:
            self.served.append(request.model)
            status, body = 200, completion()
        await self._send(
            protocol.ResponseComplete(
                request_id=request.request_id,
                status_code=status,
                headers={"content-type": "application/json"},
                body=body,
            )
        )

    def loads(self) -> list[str]:
        return [model for kind, model in self.ops if kind == "load"]

    def unloads(self) -> list[str]:
        return [model for kind, model in self.ops if kind == "unload"]
