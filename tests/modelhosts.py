"""Fakes of the backends that load models on demand, after their documented APIs.

Each is a :class:`tests.upstream.FakeUpstream` (so generation requests are answered as
there) that also keeps a state per model and answers its kind's model routes:

- :class:`FakeLlamaRouter`: llama-server in router mode (``GET /models``, ``/props``,
  ``/props?model=``, ``POST /models/load`` / ``/models/unload``, ``GET /models/sse``);
  ``hold_streams`` keeps each chat stream open after its first events until its model
  is unloaded, then ends the body cleanly with no ``[DONE]``, after a bare ``proxy
  error: Failed to read connection``, as the real router does;
- :class:`FakeLlamaSwap`: ``GET /v1/models``, ``GET /running``,
  ``GET /upstream/{model}/health``, ``POST /api/models/unload/{model}``;
- :class:`FakeOllama`: ``GET /api/tags``, ``GET /api/ps``, ``POST /api/generate``;
- :class:`FakeVllm`: ``GET /v1/models``, ``GET /is_sleeping``, ``POST /sleep``,
  ``POST /wake_up``, ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``.

Tests change states behind the worker's back with :meth:`FakeModelHost.set_state` (an
operator, another client), make loads wait on :attr:`FakeModelHost.gate`, make a
model's load fail with :attr:`FakeModelHost.failing`, and read :attr:`FakeModelHost.ops`
(what the backend was asked to do).
"""

from __future__ import annotations

import asyncio
from typing import Any, Self
from urllib.parse import parse_qs, unquote

import msgspec

from tests.upstream import CREATED, FakeUpstream, Recorded, _sse

_json = msgspec.json.Encoder()


class FakeModelHost(FakeUpstream):
    """A backend with a state per model; subclasses answer their kind's routes."""

    def __init__(self, states: dict[str, str], **options: Any) -> None:
        super().__init__(models=list(states), **options)
        self.states = dict(states)
        #: Set: loads finish at once; cleared: they wait until it is set.
        self.gate = asyncio.Event()
        self.gate.set()
        #: Model -> the error its load fails with.
        self.failing: dict[str, str] = {}
        #: (op, model) for every load and unload the backend was asked for.
        self.ops: list[tuple[str, str]] = []
        self._listeners: list[asyncio.Queue[dict[str, Any]]] = []
        self._background: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))
        await super().close()

    def set_state(self, model: str, state: str) -> None:
        """Change a state as the backend would by itself (and announce it)."""
        self.states[model] = state
        self.notify(model, state)

    def notify(self, model: str, state: str) -> None:
        for queue in self._listeners:
            queue.put_nowait({"model": model, "event": "status_change", "data": {"status": state}})

    async def _answer(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        answer = await self.manage(rec, reader, writer)
        if answer is None:
            return await super()._answer(rec, reader, writer)
        if isinstance(answer, tuple):
            status, document = answer
            self._write_json(writer, status, document)
        rec.finished.set()
        return True

    async def manage(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, Any] | bool | None:
        """The answer to a model route: (status, document), True when written, None
        for any other request (answered as by :class:`FakeUpstream`)."""
        return None

    async def _loaded(self, model: str) -> str | None:
        """Wait for the gate; the error of a failing load, else None."""
        self.ops.append(("load", model))
        await self.gate.wait()
        return self.failing.get(model)


def _body(rec: Recorded) -> dict[str, Any]:
    try:
        document = msgspec.json.decode(rec.body) if rec.body else {}
    except msgspec.DecodeError:
        return {}
    return document if isinstance(document, dict) else {}


def _error(message: str, code: int = 400) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": "invalid_request_error"}}


class FakeLlamaRouter(FakeModelHost):
    """llama-server ``--models-dir`` (router mode); ``states`` in the router's words
    (``loaded``, ``loading``, ``unloaded``, ``sleeping``)."""

    def __init__(
        self,
        states: dict[str, str],
        *,
        models_max: int = 4,
        slots: int = 2,
        events: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(states, **options)
        self.models_max = models_max
        self.slots = slots
        #: Whether ``GET /models/sse`` exists (routers before it answer 404), and
        #: whether it fails (500) for now.
        self.events = events
        self.events_broken = False
        self.exit_codes: dict[str, int] = {}
        #: Chat streams stay open after their first events until their model unloads.
        self.hold_streams = False
        self._unloaded: dict[str, asyncio.Event] = {}

    def set_state(self, model: str, state: str) -> None:
        super().set_state(model, state)
        if state == "unloaded":
            self._unloaded.pop(model, asyncio.Event()).set()

    async def manage(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, Any] | bool | None:
        if rec.method == "GET" and rec.path in ("/models", "/v1/models"):
            return 200, {"object": "list", "data": [self._entry(m) for m in self.states]}
        if rec.method == "GET" and rec.path == "/props":
            model = parse_qs(rec.query).get("model", [""])[0]
            if not model:
                return 200, {"role": "router", "max_instances": self.models_max}
            if self.states.get(model) != "loaded":
                return 400, _error("model is not loaded")
            return 200, {"total_slots": self.slots, "model_alias": model}
        if rec.method == "GET" and rec.path == "/slots":
            model = parse_qs(rec.query).get("model", [""])[0]
            if self.states.get(model) == "sleeping":
                self.set_state(model, "loaded")  # any call that needs the model wakes it
            return 200, [{"id": i, "is_processing": False} for i in range(self.slots)]
        if rec.method == "GET" and rec.path == "/models/sse":
            if not self.events:
                return 404, _error("File Not Found", 404)
            if self.events_broken:
                return 500, _error("the event stream failed", 500)
            await self._events(reader, writer)
            return True
        if rec.method == "POST" and rec.path == "/models/load":
            return await self._load(_body(rec).get("model", ""))
        if rec.method == "POST" and rec.path == "/models/unload":
            model = _body(rec).get("model", "")
            if model not in self.states:
                return 400, _error("model is not found")
            if self.states[model] not in ("loaded", "loading", "sleeping"):
                return 400, _error("model is not running")
            self.ops.append(("unload", model))
            self.set_state(model, "unloaded")
            return 200, {"success": True}
        if rec.method == "POST" and rec.path == "/v1/chat/completions" and self.hold_streams:
            await self._held_stream(_body(rec).get("model", ""), reader, writer)
            return True
        return None

    def _entry(self, model: str) -> dict[str, Any]:
        status: dict[str, Any] = {"value": self.states[model], "args": ["llama-server"]}
        if model in self.exit_codes and self.states[model] == "unloaded":
            status |= {"failed": True, "exit_code": self.exit_codes[model]}
        return {
            "id": model,
            "aliases": [],
            "tags": [],
            "object": "model",
            "owned_by": "llamacpp",
            "created": CREATED,
            "status": status,
        }

    async def _load(self, model: str) -> tuple[int, Any]:
        if model not in self.states:
            return 404, _error("model is not found", 404)
        if self.states[model] in ("loaded", "loading", "sleeping"):
            return 400, _error("model is already running")
        running = [m for m, s in self.states.items() if s in ("loaded", "loading")]
        if len(running) >= self.models_max:
            self.set_state(running[0], "unloaded")  # the router evicts by itself
        self.exit_codes.pop(model, None)
        self.set_state(model, "loading")
        self._finish_later(model)
        return 200, {"success": True}

    def _finish_later(self, model: str) -> None:
        async def finish() -> None:
            problem = await self._loaded(model)
            if self.states.get(model) != "loading":
                return
            if problem is not None:
                self.exit_codes[model] = 1
            self.set_state(model, "unloaded" if problem is not None else "loaded")

        task = asyncio.ensure_future(finish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _events(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._listeners.append(queue)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        gone = asyncio.ensure_future(reader.read(1))
        try:
            while True:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return
                event = b"data: " + _json.encode(item.result()) + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
        finally:
            gone.cancel()
            self._listeners.remove(queue)

    async def _held_stream(
        self, model: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Two events, then nothing until ``model`` unloads; then a clean end with no
        [DONE], after a bare ``proxy error`` line (as llama-server's router ends it)."""
        unloaded = self._unloaded.setdefault(model, asyncio.Event())
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": CREATED}
        for delta in ({"role": "assistant", "content": ""}, {"content": " t0"}):
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            event = _sse(base | {"model": model, "choices": [choice]})
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        gone = asyncio.ensure_future(reader.read(1))
        until = asyncio.ensure_future(unloaded.wait())
        await asyncio.wait({gone, until}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        until.cancel()
        if unloaded.is_set():  # what the router writes when the model's server went
            junk = b"proxy error: Failed to read connection"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(junk), junk))
            await writer.drain()


class FakeLlamaSwap(FakeModelHost):
    """llama-swap; ``states`` in its words (``ready``, ``starting``, ``stopping``,
    ``stopped``). ``peers`` are listed as another box's models."""

    def __init__(self, states: dict[str, str], *, peers: list[str] | None = None) -> None:
        super().__init__(states)
        self.peers = peers or []
        #: False: a llama-swap from before ``POST /api/models/unload/{model}``.
        self.unload_one = True

    async def manage(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, Any] | bool | None:
        if rec.method == "GET" and rec.path == "/v1/models":
            data = [self._entry(m, "model") for m in self.states]
            data += [self._entry(f"box-2: {p}", "peer") for p in self.peers]
            return 200, {"object": "list", "data": data}
        if rec.method == "GET" and rec.path == "/running":
            running = [
                {"model": m, "state": s, "cmd": "llama-server", "proxy": "", "ttl": 0}
                for m, s in self.states.items()
                if s != "stopped"
            ]
            return 200, {"running": running}
        if rec.path.startswith("/upstream/"):
            model = unquote(rec.path.removeprefix("/upstream/").rsplit("/", 1)[0])
            if model not in self.states:
                return 404, b"model not found"
            if self.states[model] != "ready":
                self.set_state(model, "starting")
                problem = await self._loaded(model)
                if problem is not None:
                    self.set_state(model, "stopped")
                    return 502, {"error": problem}
                self.set_state(model, "ready")
            return 200, {"status": "ok"}
        if rec.method == "POST" and rec.path.startswith("/api/models/unload/"):
            if not self.unload_one:
                return 404, b"404 page not found\n"
            model = unquote(rec.path.removeprefix("/api/models/unload/"))
            if model not in self.states:
                return 404, b"model not found"
            self.ops.append(("unload", model))
            self.set_state(model, "stopped")
            return 200, b"OK"
        return None

    @staticmethod
    def _entry(model: str, kind: str) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": CREATED,
            "owned_by": "llama-swap",
            "status": {"value": "unloaded"},
            "meta": {"llamaswap": {"type": kind}},
        }


class FakeOllama(FakeModelHost):
    """Ollama; ``states``: ``loaded`` (in ``/api/ps``) or ``loadable`` (pulled only)."""

    async def manage(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, Any] | bool | None:
        if rec.method == "GET" and rec.path == "/v1/models":
            data = [
                {"id": m, "object": "model", "created": CREATED, "owned_by": "library"}
                for m in self.states
            ]
            return 200, {"object": "list", "data": data}
        if rec.method == "GET" and rec.path in ("/api/tags", "/api/ps"):
            names = [m for m, s in self.states.items() if rec.path == "/api/tags" or s == "loaded"]
            return 200, {"models": [{"name": m, "model": m, "size": 1} for m in names]}
        if rec.method == "POST" and rec.path == "/api/generate":
            body = _body(rec)
            model = body.get("model", "")
            if model not in self.states:
                return 404, {"error": f"model '{model}' not found"}
            if body.get("keep_alive") == 0:
                self.ops.append(("unload", model))
                self.set_state(model, "loadable")
                return 200, {"model": model, "response": "", "done": True, "done_reason": "unload"}
            problem = await self._loaded(model)
            if problem is not None:
                return 500, {"error": problem}
            self.set_state(model, "loaded")
            return 200, {"model": model, "response": "", "done": True}
        return None


class FakeVllm(FakeModelHost):
    """vLLM serving ``base``, with sleep mode (``sleep_mode``) and runtime LoRA
    adapters; ``states`` are the adapters in memory (``loaded``)."""

    def __init__(
        self, base: str, adapters: dict[str, str] | None = None, *, sleep_mode: bool = True
    ) -> None:
        super().__init__({base: "loaded", **(adapters or {})})
        #: Adapter -> the path it was loaded from.
        self.paths: dict[str, str] = {}
        self.base = base
        self.sleep_mode = sleep_mode
        self.sleeping = False

    async def manage(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, Any] | bool | None:
        if rec.method == "GET" and rec.path == "/v1/models":
            data = [self._entry(self.base, None)]
            data += [
                self._entry(m, self.base)
                for m, s in self.states.items()
                if m != self.base and s == "loaded"
            ]
            return 200, {"object": "list", "data": data}
        if rec.path in ("/is_sleeping", "/sleep", "/wake_up") and not self.sleep_mode:
            return 404, {"detail": "Not Found"}
        if rec.method == "GET" and rec.path == "/is_sleeping":
            return 200, {"is_sleeping": self.sleeping}
        if rec.method == "POST" and rec.path in ("/sleep", "/wake_up"):
            self.ops.append(
                (rec.path.lstrip("/") + ("?" + rec.query if rec.query else ""), self.base)
            )
            if rec.path == "/wake_up" and self.sleeping:
                await self.gate.wait()
            self.sleeping = rec.path == "/sleep"
            return 200, b""
        if rec.method == "POST" and rec.path == "/v1/load_lora_adapter":
            body = _body(rec)
            name, path = body.get("lora_name", ""), body.get("lora_path", "")
            if self.states.get(name) == "loaded":
                return 400, _error(f"The lora adapter '{name}' has already been loaded.")
            problem = await self._loaded(name)
            if problem is not None or not path:
                return 400, _error(problem or "no lora_path")
            self.set_state(name, "loaded")
            self.paths[name] = path
            return 200, b"Success: LoRA adapter added successfully."
        if rec.method == "POST" and rec.path == "/v1/unload_lora_adapter":
            name = _body(rec).get("lora_name", "")
            if self.states.get(name) != "loaded":
                return 404, _error(f"The lora adapter '{name}' cannot be found.", 404)
            self.ops.append(("unload", name))
            self.set_state(name, "loadable")
            return 200, b"Success: LoRA adapter removed successfully."
        return None

    def _entry(self, model: str, parent: str | None) -> dict[str, Any]:
        root = f"/models/{model}" if parent is None else self.paths.get(model, f"/loras/{model}")
        return {
            "id": model,
            "object": "model",
            "created": CREATED,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": 4096,
        }
