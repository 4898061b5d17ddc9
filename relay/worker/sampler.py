"""The worker's metrics sample (SPEC §17): its backend's Prometheus endpoint, its own
process, and its GPUs where NVML is there.

GPU boxes accept no inbound connections, so Prometheus cannot scrape the backends on
them. When the relay accepts the ``metrics`` extension, the session sends a
:class:`~relay.wire.protocol.MetricsSample` every ``--backend-metrics-secs``: the
backend's exposition as it answered (llama-server with ``--metrics``, vLLM, SGLang,
TGI), followed by the worker's own series, all prefixed ``modelrelay_worker_`` so
they never collide with a backend's. The relay parses it and serves it at
``GET /metrics/workers`` with ``worker`` and ``provider`` labels.

GPU series come from NVML through ``nvidia-ml-py`` (module ``pynvml``) when it is
installed and finds a driver; it is optional, imported by name like uvloop, so the
worker never needs it. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from types import ModuleType, TracebackType
from typing import Any

import httpx

from relay.wire.protocol import MetricsRejected, MetricsSample
from relay.worker.config import Config

log = logging.getLogger("modelrelay.worker")

#: The most of a backend's exposition the worker reads; the relay's own bound (its
#: WORKER_METRICS_MAX_BYTES) is usually lower, and it says so when a sample passes it.
MAX_BACKEND_BYTES = 16 * 1024 * 1024
#: Asked of the backend: the classic text format, which every exporter serves.
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"

_STARTED = time.time()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Exposition:
    """Prometheus text lines for the worker's own families (HELP and TYPE once each)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
        """``samples``: (label text such as ``{gpu="0"}`` or empty, value)."""
        if not samples:
            return
        self.lines.append(f"# HELP {name} {text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{labels} {value!r}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""


def process_series(out: Exposition, in_flight: int) -> None:
    """The worker process: CPU, memory, open files, start time, requests in flight."""
    times = os.times()
    out.family(
        "modelrelay_worker_process_cpu_seconds_total",
        "counter",
        "CPU time of the worker process (user and system).",
        [("", times.user + times.system)],
    )
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = None  # not Linux
    if resident is not None:
        out.family(
            "modelrelay_worker_process_resident_memory_bytes",
            "gauge",
            "Resident memory of the worker process.",
            [("", float(resident))],
        )
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = None
    if fds is not None:
        out.family(
            "modelrelay_worker_process_open_fds",
            "gauge",
            "Open file descriptors of the worker process.",
            [("", float(fds))],
        )
    out.family(
        "modelrelay_worker_process_start_time_seconds",
        "gauge",
        "When the worker process started (Unix time).",
        [("", _STARTED)],
    )
    out.family(
        "modelrelay_worker_requests_in_flight",
        "gauge",
        "Requests the worker is forwarding to its backend now.",
        [("", float(in_flight))],
    )


class Gpus:
    """NVML's view of this box's GPUs, when ``pynvml`` is installed and finds a driver."""

    def __init__(self, loader: Callable[[str], ModuleType] = importlib.import_module) -> None:
        self._nvml: Any = None
        try:
            nvml = loader("pynvml")
            nvml.nvmlInit()
        except Exception as exc:  # not installed, no driver, no GPU: no GPU series
            log.debug("no GPU metrics: %s", exc)
            return
        self._nvml = nvml

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[tuple[str, dict[str, float]]]:
        """Per GPU: its label text and the readings NVML gave (blocking; off the loop)."""
        nvml = self._nvml
        found: list[tuple[str, dict[str, float]]] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            readings: dict[str, float] = {}
            for key, read in (
                ("util", lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100),
                ("used", lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).used)),
                ("total", lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).total)),
                ("power", lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000),
            ):
                try:
                    readings[key] = read(handle)
                except Exception:  # a reading this GPU does not support
                    pass
            found.append((f'{{gpu="{index}",name="{_label(str(name))}"}}', readings))
        return found

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def gpu_series(out: Exposition, gpus: list[tuple[str, dict[str, float]]]) -> None:
    for key, name, kind, text in (
        ("util", "modelrelay_worker_gpu_utilization_ratio", "gauge", "GPU busy time (0-1)."),
        ("used", "modelrelay_worker_gpu_memory_used_bytes", "gauge", "GPU memory in use."),
        ("total", "modelrelay_worker_gpu_memory_total_bytes", "gauge", "GPU memory in all."),
        ("power", "modelrelay_worker_gpu_power_watts", "gauge", "GPU power draw."),
    ):
        out.family(name, kind, text, [(lab, r[key]) for lab, r in gpus if key in r])


class Sampler:
    """Reads one sample at a time; open it with ``async with`` (one HTTP client)."""

    def __init__(self, url: str, interval: float, timeout: float, gpus: Gpus | None = None) -> None:
        self.url = url
        self.interval = interval
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            headers={"accept": ACCEPT},
        )
        self._gpus = gpus if gpus is not None else Gpus()
        self._was_up: bool | None = None

    async def __aenter__(self) -> Sampler:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.aclose()
        self._gpus.close()

    async def backend_text(self) -> str | None:
        """The backend's exposition, or None (logged when that changes) if unavailable."""
        problem = None
        body = bytearray()
        try:
            async with self._client.stream("GET", self.url) as response:
                if response.status_code != 200:
                    problem = f"HTTP {response.status_code}"
                else:
                    body = bytearray()
                    async for part in response.aiter_bytes():
                        body += part
                        if len(body) > MAX_BACKEND_BYTES:
                            problem = f"larger than {MAX_BACKEND_BYTES} bytes"
                            break
        except httpx.HTTPError as exc:
            problem = str(exc) or type(exc).__name__
        up = problem is None
        if up != self._was_up:
            if up:
                log.info("reading the backend's metrics at %s", self.url)
            else:
                log.info(
                    "the backend's metrics at %s are unavailable (%s); sending the worker's "
                    "own only (--no-backend-metrics turns this off)",
                    self.url,
                    problem,
                )
            self._was_up = up
        if not up:
            return None
        text = body.decode(errors="replace")
        # An OpenMetrics answer ends with "# EOF": the worker's own series follow it.
        stripped = text.rstrip()
        return stripped[: -len("# EOF")] if stripped.endswith("# EOF") else text

    async def sample(self, in_flight: int) -> MetricsSample:
        started = time.monotonic()
        backend = await self.backend_text()
        out = Exposition()
        out.family(
            "modelrelay_worker_backend_up",
            "gauge",
            "1 when the backend's metrics endpoint answered the last read.",
            [("", 1.0 if backend is not None else 0.0)],
        )
        out.family(
            "modelrelay_worker_backend_scrape_duration_seconds",
            "gauge",
            "How long reading the backend's metrics took.",
            [("", time.monotonic() - started)],
        )
        process_series(out, in_flight)
        if self._gpus.available:
            try:
                gpu_series(out, await asyncio.to_thread(self._gpus.read))
            except Exception as exc:
                log.warning("reading GPU metrics failed (%s); no GPU series this time", exc)
        own = out.text()
        if backend is None:
            text = own
        else:
            text = backend if backend.endswith("\n") or not backend else backend + "\n"
            text += own
        return MetricsSample(text=text, backend_up=backend is not None, interval_secs=self.interval)


class Federating:
    """One connection's side of the ``metrics`` extension (the session owns one)."""

    def __init__(self) -> None:
        self.refused = False

    async def run(
        self,
        config: Config,
        send: Callable[[MetricsSample], Awaitable[None]],
        load: Callable[[], int],
    ) -> None:
        """Send a sample now and every ``--backend-metrics-secs`` until cancelled (once
        the relay accepted the extension)."""
        assert config.backend_metrics_url is not None
        interval = config.backend_metrics_secs
        url, timeout = config.backend_metrics_url, config.backend_metrics_timeout
        async with Sampler(url, interval, timeout) as sampler:
            while True:
                try:
                    sample = await sampler.sample(load())
                except Exception:  # a bug here must not stop the next samples
                    log.exception("reading the metrics failed; trying again in %gs", interval)
                else:
                    await send(sample)  # a closed connection ends the loop
                await asyncio.sleep(interval)

    def rejected(self, message: MetricsRejected) -> None:
        """The relay dropped a sample: said once per connection (the next samples are
        most likely the same size)."""
        refused, self.refused = self.refused, True
        log.log(
            logging.DEBUG if refused else logging.WARNING,
            "the proxy dropped this worker's metrics: %s (its bounds: %d bytes, %d series)",
            message.reason,
            message.max_bytes,
            message.max_series,
        )
