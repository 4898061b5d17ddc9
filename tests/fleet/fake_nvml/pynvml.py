"""A stand-in for nvidia-ml-py's ``pynvml`` on machines without an NVIDIA driver.

Put this folder on the worker's ``PYTHONPATH`` and the real ``worker.py`` reads one
GPU through it: NVML is the one piece of hardware I/O the fleet tests cannot reach.
"""

from __future__ import annotations

from types import SimpleNamespace


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetName(handle: int) -> str:
    return "Test GPU 24GB"


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=42, memory=10)


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    return SimpleNamespace(used=6 * 2**30, total=24 * 2**30, free=18 * 2**30)


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return 180_000  # milliwatts
