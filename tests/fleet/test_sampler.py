"""The worker's metrics sample (:mod:`relay.worker.sampler`) against the fake upstream."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from relay.wire.protocol import MetricsSample
from relay.worker.sampler import Gpus, Sampler
from tests.fleet.backends import LLAMA_SERVER
from tests.upstream import FakeUpstream


def values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


class NoGpus(Gpus):
    def __init__(self) -> None:
        self._nvml = None


async def sample_from(metrics_text: str | None, gpus: Gpus | None = None) -> MetricsSample:
    """One sample read from a fake backend answering ``metrics_text`` (None: 404)."""
    async with FakeUpstream() as up:
        up.metrics_text = metrics_text
        async with Sampler(up.url + "/metrics", 15, 5, gpus or NoGpus()) as sampler:
            return await sampler.sample(in_flight=0)


async def test_a_sample_is_the_backends_exposition_then_the_workers_own_series() -> None:
    async with FakeUpstream() as up:
        up.metrics_text = LLAMA_SERVER
        async with Sampler(up.url + "/metrics", 15, 5, NoGpus()) as sampler:
            sample = await sampler.sample(in_flight=2)
    assert sample.backend_up and sample.interval_secs == 15
    assert sample.text.startswith(LLAMA_SERVER)
    found = values(sample.text)
    assert found["llamacpp:kv_cache_usage_ratio"] == [({}, 0.25)]
    assert found["modelrelay_worker_backend_up"] == [({}, 1.0)]
    assert found["modelrelay_worker_requests_in_flight"] == [({}, 2.0)]
    assert found["modelrelay_worker_process_cpu_seconds_total"][0][1] > 0
    [(_, accept)] = [(r.path, r.headers["accept"]) for r in up.requests]
    assert accept.startswith("text/plain;version=0.0.4")


async def test_an_openmetrics_answer_loses_its_eof_so_the_workers_series_still_parse() -> None:
    sample = await sample_from("# TYPE q gauge\nq 1\n# EOF\n")
    found = values(sample.text)
    assert found["q"] == [({}, 1.0)]
    assert "modelrelay_worker_backend_up" in found


async def test_a_backend_without_metrics_leaves_the_workers_own_series_and_says_so() -> None:
    sample = await sample_from(None)  # GET /metrics answers 404
    assert not sample.backend_up
    found = values(sample.text)
    assert found["modelrelay_worker_backend_up"] == [({}, 0.0)]
    assert not any(name.startswith("llamacpp") for name in found)


def fake_nvml() -> ModuleType:
    """NVML as nvidia-ml-py exposes it, for two GPUs (the second without power readings)."""
    module = ModuleType("pynvml")
    calls: dict[str, Any] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: b'NVIDIA "A100"' if h == 0 else "RTX 4090",
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=75 if h == 0 else 5),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=10 * 2**30, total=80 * 2**30),
    }

    def power(handle: int) -> int:
        if handle == 1:
            raise RuntimeError("not supported")
        return 250_500  # milliwatts

    calls["nvmlDeviceGetPowerUsage"] = power
    for name, function in calls.items():
        setattr(module, name, function)
    return module


async def test_gpu_series_come_from_nvml_when_it_is_there() -> None:
    gpus = Gpus(loader=lambda name: fake_nvml())
    assert gpus.available
    sample = await sample_from(None, gpus)
    found = values(sample.text)
    util = {
        labels["gpu"]: value for labels, value in found["modelrelay_worker_gpu_utilization_ratio"]
    }
    assert util == {"0": 0.75, "1": 0.05}
    [(labels, watts)] = found["modelrelay_worker_gpu_power_watts"]
    assert labels == {"gpu": "0", "name": 'NVIDIA "A100"'} and watts == 250.5
    assert len(found["modelrelay_worker_gpu_memory_total_bytes"]) == 2


def test_without_nvml_there_are_no_gpu_series() -> None:
    def missing(name: str) -> ModuleType:
        raise ImportError(name)

    assert not Gpus(loader=missing).available
