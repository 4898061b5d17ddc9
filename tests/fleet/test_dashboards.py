"""The Grafana dashboard and the Prometheus configuration in deploy/ (SPEC §17): valid,
their alerts fire when they should (``promtool``), and every metric they name exists in
a live scrape of a server with workers in front of llama-server and vLLM."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import IN_CI
from tests.fleet.backends import LLAMA_SERVER, VLLM
from tests.live import ROOT, live_server
from tests.test_e2e import poll, running_worker
from tests.upstream import upstream_in_thread

DASHBOARD = ROOT / "deploy" / "grafana" / "modelrelay-fleet.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yml")

#: PromQL words that are not metric names.
_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (make promtool installs Debian's prometheus)"
        if IN_CI:
            pytest.fail(reason + "; CI requires it", pytrace=False)
        pytest.skip(reason)
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = match.group()
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS or name.startswith("$"):
            continue  # a function or aggregation, a keyword, a Grafana variable
        if text[: match.start()].endswith("$"):
            continue
        names.add(name)
    return names


def dashboard_exprs() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in document["panels"] for t in p.get("targets", [])]
    exprs += [grafana_query(v["definition"]) for v in document["templating"]["list"]]
    return exprs


def grafana_query(definition: str) -> str:
    """The PromQL of a variable's query (``label_values(expr, label)`` reads ``expr``)."""
    match = re.fullmatch(r"label_values\((.*),\s*\w+\)", definition.strip())
    return match.group(1) if match else definition


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_it_reads_metric_names_out_of_promql() -> None:
    expr = (
        'sum by (le, endpoint) (rate(a_bucket{x=~"$i", y!="b c"}[$__rate_interval])) '
        "/ on (instance) group_left () (llamacpp:kv > 0) or vector(1)"
    )
    assert metric_names(expr) == {"a_bucket", "llamacpp:kv"}
    # Grafana's label_values(metric, label) reads the metric only.
    assert metric_names(grafana_query("label_values(modelrelay_process, instance)")) == {
        "modelrelay_process"
    }


def test_the_dashboard_is_importable_grafana_json() -> None:
    document = json.loads(DASHBOARD.read_text())
    assert document["uid"] and document["title"]
    assert document["__inputs"][0]["type"] == "datasource"
    panels = [p for p in document["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in document["panels"]}) == len(document["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("requests", "errors", "queue", "first byte", "tokens", "worker", "kv cache"):
        assert topic in titles, topic
    assert "prompt throughput" in titles


def test_the_alert_rules_have_the_shape_prometheus_loads() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    [group] = rules["groups"]
    names = set()
    for rule in group["rules"]:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["expr"].count("(") == rule["expr"].count(")")
        names.add(rule["alert"])
    assert names == {
        "ModelRelayNoWorkerForModel",
        "ModelRelayQueueNearBound",
        "ModelRelayErrorRatio",
        "ModelRelayWorkerBackendMetricsStale",
    }
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    paths = {job["metrics_path"] for job in config["scrape_configs"]}
    assert paths == {"/metrics", "/metrics/workers"}


def test_promtool_accepts_the_rules_and_the_config_and_the_alerts_fire_as_tested(
    tmp_path: Path,
) -> None:
    binary = promtool()
    checked = subprocess.run(
        [binary, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The config names a token file that exists only where Prometheus runs.
    token = tmp_path / "token"
    token.write_text("secret\n")
    config = PROMETHEUS.read_text().replace("/etc/prometheus/modelrelay-metrics-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    checked = subprocess.run(
        [binary, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [binary, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def scraped_names(url: str, path: str) -> set[str]:
    answer = httpx.get(url + path, timeout=10)
    assert answer.status_code == 200
    return {
        sample.name
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


@pytest.mark.live
def test_every_metric_of_the_dashboard_and_the_alerts_exists_in_a_live_scrape(
    tmp_path: Path,
) -> None:
    wanted: dict[str, set[str]] = {}
    for expr in dashboard_exprs() + alert_exprs():
        for name in metric_names(expr):
            wanted.setdefault(name, set()).add(expr)
    assert "llamacpp:kv_cache_usage_ratio" in wanted and "modelrelay_responses_total" in wanted
    gpu = {**os.environ, "PYTHONPATH": str(Path(__file__).with_name("fake_nvml"))}
    fast = ("--backend-metrics-secs", "0.2")
    with (
        upstream_in_thread() as llama,
        upstream_in_thread() as vllm,
        live_server(tmp_path / "server") as server,
        running_worker(server, llama.url, "--worker-name", "llama-box", *fast, env=gpu),
        running_worker(server, vllm.url, "--worker-name", "vllm-box", *fast),
    ):
        llama.upstream.metrics_text = LLAMA_SERVER
        vllm.upstream.metrics_text = VLLM

        def scraped() -> set[str]:
            return scraped_names(server.url, "/metrics") | scraped_names(
                server.url, "/metrics/workers"
            )

        poll(
            lambda: {"vllm:kv_cache_usage_perc", "modelrelay_worker_gpu_power_watts"} <= scraped(),
            what="both workers' samples",
        )
        statuses = [
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10).status_code
            for body in ({"model": "mock-model", "messages": []}, {"model": "nothing-here"})
        ]
        assert statuses == [200, 404]
        names = scraped()
    missing: dict[str, Any] = {n: sorted(e) for n, e in wanted.items() if n not in names}
    assert missing == {}
