"""Backend metrics federation end to end (SPEC §17): a fake llama-server serving
``/metrics`` behind the real ``worker.py``, a live server, ``GET /metrics/workers``."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet.backends import LLAMA_SERVER
from tests.fleet.test_federation import (
    HONEST,
    HOSTILE,
    HOSTILE_FAMILIES,
    HOSTILE_SERVED,
    Series,
    exposition,
    of_worker,
)
from tests.live import live_server
from tests.test_e2e import poll, running_worker, workers_connected
from tests.upstream import upstream_in_thread

pytestmark = pytest.mark.live

TOKEN = "metrics-token-for-tests"
FAST_METRICS = ("--backend-metrics-secs", "0.2")


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics/workers`` parsed: sample name -> [(labels, value)]."""
    answer = httpx.get(
        url + "/metrics/workers", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_backend_series_appear_with_the_worker_label_and_vanish_when_it_leaves(
    tmp_path: Path,
) -> None:
    with (
        upstream_in_thread() as up,
        live_server(tmp_path / "server", MODELRELAY_METRICS_TOKEN=TOKEN) as server,
    ):
        up.upstream.metrics_text = LLAMA_SERVER
        unauthorized = httpx.get(server.url + "/metrics/workers", timeout=5)
        assert unauthorized.status_code == 403
        assert scrape(server.url).get("llamacpp:prompt_tokens_total") is None
        with running_worker(server, up.url, "--worker-name", "gpu-box-1", *FAST_METRICS) as worker:
            poll(lambda: "llamacpp:kv_cache_usage_ratio" in scrape(server.url), what="series")
            series = scrape(server.url)
            [(labels, value)] = series["llamacpp:kv_cache_usage_ratio"]
            assert value == 0.25
            assert labels["worker"] == "gpu-box-1"
            assert labels["provider"] == server.provider
            assert labels["worker_id"].startswith("w-")
            [(_, prompt_tokens)] = series["llamacpp:prompt_tokens_total"]
            assert prompt_tokens == 1234
            # The worker's own series and the relay's view of the sample come along.
            [(own, up_value)] = series["modelrelay_worker_backend_up"]
            assert own["worker"] == "gpu-box-1" and up_value == 1
            assert series["modelrelay_worker_process_resident_memory_bytes"][0][1] > 0
            [(_, age)] = series["modelrelay_worker_metrics_age_seconds"]
            assert 0 <= age < 30
            [(_, interval)] = series["modelrelay_worker_metrics_interval_seconds"]
            assert interval == 0.2
            # The worker announced the extension and the relay read the backend for it.
            assert any(r.path == "/metrics" for r in up.requests)
            worker.signal(signal.SIGTERM)
            assert worker.wait() == 0
        poll(lambda: workers_connected(server) == 0, what="the worker to leave")
        after = scrape(server.url)
        assert "llamacpp:kv_cache_usage_ratio" not in after
        assert "modelrelay_worker_metrics_age_seconds" not in after


def test_an_oversized_sample_is_dropped_and_the_worker_stays_connected(tmp_path: Path) -> None:
    with (
        upstream_in_thread() as up,
        live_server(
            tmp_path / "server", MODELRELAY_METRICS_TOKEN=TOKEN, WORKER_METRICS_MAX_SERIES="5"
        ) as server,
    ):
        up.upstream.metrics_text = LLAMA_SERVER  # 11 series and the worker's own
        with running_worker(server, up.url, *FAST_METRICS) as worker:
            worker.wait_for_log("dropped this worker's metrics")
            assert "over the relay's bound" in worker.log
            assert "(its bounds: 2097152 bytes, 5 series)" in worker.log
            server.wait_for_log("metrics sample dropped")
            assert workers_connected(server) == 1
            assert "llamacpp:prompt_tokens_total" not in scrape(server.url)
            # Still serving requests on the same connection.
            answer = httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            assert answer.status_code == 200
            assert worker.log.count("connected to proxy") == 1


def checked(url: str) -> set[Series]:
    """``/metrics/workers`` checked whole as a scraper reads it (:func:`exposition`)."""
    answer = httpx.get(
        url + "/metrics/workers", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    assert answer.status_code == 200, answer.text
    return exposition(answer.content)


def worker_ids(url: str) -> dict[str, str]:
    """Worker name -> worker id, from the relay's own series about the samples."""
    return {
        dict(labels)["worker"]: dict(labels)["worker_id"]
        for name, _, _, labels, _, _ in checked(url)
        if name == "modelrelay_worker_metrics_series"
    }


def test_a_worker_named_to_sort_first_cannot_hide_an_earlier_workers_families(
    tmp_path: Path,
) -> None:
    with (
        upstream_in_thread() as honest_up,
        upstream_in_thread() as hostile_up,
        live_server(tmp_path / "server", MODELRELAY_METRICS_TOKEN=TOKEN) as server,
    ):
        honest_up.upstream.metrics_text = HONEST
        hostile_up.upstream.metrics_text = HOSTILE
        with running_worker(server, honest_up.url, "--worker-name", "gpu-a", *FAST_METRICS):
            poll(lambda: "gpu-a" in worker_ids(server.url), what="the first worker's series")
            honest_id = worker_ids(server.url)["gpu-a"]
            alone = of_worker(checked(server.url), honest_id)
            assert len(alone) == 22
            with running_worker(
                server, hostile_up.url, "--worker-name", "000-evil", *FAST_METRICS
            ) as hostile:
                poll(
                    lambda: "000-evil" in worker_ids(server.url), what="the second worker's series"
                )
                hostile_id = worker_ids(server.url)["000-evil"]
                poll(
                    lambda: of_worker(checked(server.url), hostile_id) != set(),
                    what="a scrape of the second worker's sample",
                )
                series = checked(server.url)
                assert of_worker(series, honest_id) == alone
                assert {s[0] for s in of_worker(series, hostile_id)} == HOSTILE_SERVED
                conflicts = {
                    dict(s[3])["worker"]: s[4] for s in series if s[0].endswith("type_conflicts")
                }
                assert conflicts == {"gpu-a": 0, "000-evil": HOSTILE_FAMILIES}
                hostile.wait_for_log("families left out")
                assert "llamacpp:prompt_tokens (gauge)" in hostile.log
                assert workers_connected(server) == 2
