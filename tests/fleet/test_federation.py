"""The server's side of metrics federation (:mod:`relay.server.federation`), without a
socket: bounds, labels, merging across workers, and what a bad sample gets."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from relay.server import federation as federation_module
from relay.server.federation import Federation, Job, count_series, render_workers
from relay.wire.protocol import MetricsSample
from tests.fleet.backends import LLAMA_SERVER, VLLM

#: A histogram as vLLM writes it, beside the gauges and counters of :data:`VLLM`.
VLLM_HISTOGRAM = """\
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="mock-model"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="mock-model"} 4.0
vllm:e2e_request_latency_seconds_count{model_name="mock-model"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="mock-model"} 3.5
"""
HONEST = LLAMA_SERVER + VLLM + VLLM_HISTOGRAM

#: Families of the names an honest backend's families hold, each of another type: the
#: same name (counters are named without ``_total`` by the parser), a counter's
#: ``_total`` and ``_created``, a histogram's ``_count``, a sample with no type line,
#: and a family of its own that conflicts with nobody.
HOSTILE = """\
# TYPE llamacpp:prompt_tokens gauge
llamacpp:prompt_tokens 5
# TYPE llamacpp:n_decode_total gauge
llamacpp:n_decode_total 6
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created 7
# TYPE vllm:e2e_request_latency_seconds_count_total counter
vllm:e2e_request_latency_seconds_count_total 8
llamacpp:kv_cache_usage_ratio 9
# TYPE vllm:num_requests_running histogram
vllm:num_requests_running_bucket{le="+Inf"} 1
vllm:num_requests_running_count 1
vllm:num_requests_running_sum 1
# TYPE hostile_own_series gauge
hostile_own_series 10
# HELP llamacpp:kv_cache_tokens Another help text.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 11
"""
HOSTILE_FAMILIES = 6
#: The families of :data:`HOSTILE` that hold nobody's names: served.
HOSTILE_SERVED = {"hostile_own_series", "llamacpp:kv_cache_tokens"}

#: (family, type, sample name, labels, value, help text)
Series = tuple[str, str, str, tuple[tuple[str, str], ...], float, str]


def exposition(body: bytes) -> set[Series]:
    """The whole exposition checked as a scraper reads it: it parses with
    prometheus-client's parser, and each name has one TYPE line and one family (two
    blocks of a name would be one family of mixed types to a scraper); every series
    as (family, type, sample name, labels, value)."""
    text = body.decode()
    typed = re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)
    assert len(typed) == len(set(typed)), sorted(n for n in typed if typed.count(n) > 1)
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    return {
        (f.name, f.type, s.name, tuple(sorted(s.labels.items())), s.value, f.documentation)
        for f in families
        for s in f.samples
    }


def of_worker(series: set[Series], worker_id: str) -> set[Series]:
    return {
        s for s in series if ("worker_id", worker_id) in s[3] and not s[0].startswith("modelrelay_")
    }


def parsed(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 5  # samples five seconds apart
        return self.now


def federation(max_bytes: int = 1 << 20, max_series: int = 1000) -> Federation:
    return Federation(max_bytes, max_series, clock=Clock(), in_process=True)


def test_it_counts_sample_lines_not_comments_or_blanks() -> None:
    assert count_series(LLAMA_SERVER) == 11
    assert count_series('# HELP x y\n\n  # TYPE x gauge\nx 1\nx{a="b"} 2') == 2
    assert count_series("") == 0


async def test_series_of_two_workers_merge_into_one_family_each_with_their_labels() -> None:
    fed = federation()
    assert fed.receive("w-1", "box-a", "local", MetricsSample(text=LLAMA_SERVER)) is None
    assert fed.receive("w-2", "box-b", "team", MetricsSample(text=LLAMA_SERVER + VLLM)) is None
    body, refusals = await fed.render()
    assert refusals == []
    text = body.decode()
    # One HELP/TYPE per family, whatever the number of workers.
    assert text.count("# TYPE llamacpp:kv_cache_usage_ratio gauge") == 1
    series = parsed(body)
    owners = sorted((s["worker"], s["provider"]) for s, _ in series["llamacpp:prompt_tokens_total"])
    assert owners == [("box-a", "local"), ("box-b", "team")]
    [(labels, value)] = series["vllm:kv_cache_usage_perc"]
    assert value == 0.125
    assert labels == {
        "engine": "0",
        "model_name": "mock-model",
        "worker": "box-b",
        "worker_id": "w-2",
        "provider": "team",
    }


async def test_a_backend_label_named_like_ours_is_kept_as_exported() -> None:
    fed = federation()
    fed.receive("w-1", "box", "local", MetricsSample(text='up{worker="inner",x="1"} 1\n'))
    series = parsed((await fed.render())[0])
    [(labels, _)] = series["up"]
    assert labels["worker"] == "box" and labels["exported_worker"] == "inner"


async def test_a_new_sample_replaces_the_last_and_forget_removes_the_workers_series() -> None:
    fed = federation()
    fed.receive("w-1", "box", "local", MetricsSample(text="queue_len 3\n"))
    fed.receive("w-1", "box", "local", MetricsSample(text="queue_len 4\n", backend_up=False))
    series = parsed((await fed.render())[0])
    assert [v for _, v in series["queue_len"]] == [4]
    assert [v for _, v in series["modelrelay_worker_metrics_backend_up"]] == [0]
    fed.forget("w-1")
    series = parsed((await fed.render())[0])
    assert "queue_len" not in series
    assert "modelrelay_worker_metrics_age_seconds" not in series


def test_samples_over_a_bound_are_refused_with_the_bounds_and_nothing_is_kept() -> None:
    fed = federation(max_bytes=200, max_series=3)
    too_many = fed.receive("w-1", "box", "local", MetricsSample(text="a 1\nb 2\nc 3\nd 4\n"))
    assert too_many is not None
    assert "4 series" in too_many.reason
    assert (too_many.max_bytes, too_many.max_series) == (200, 3)
    too_big = fed.receive("w-1", "box", "local", MetricsSample(text="# " + "x" * 300 + "\na 1\n"))
    assert too_big is not None and "bytes" in too_big.reason
    assert fed.samples == {} and fed.rejected == 2


async def test_a_sample_that_does_not_parse_is_dropped_and_reported_once() -> None:
    fed = federation()
    fed.receive("w-1", "good", "local", MetricsSample(text="fine 1\n"))
    fed.receive("w-2", "bad", "local", MetricsSample(text='broken{label="x} 1\n'))
    body, refusals = await fed.render()
    [(worker_id, refusal)] = refusals
    assert worker_id == "w-2" and "does not parse" in refusal.reason
    series = parsed(body)
    assert [s["worker"] for s, _ in series["fine"]] == ["good"]
    assert "broken" not in body.decode()
    assert (await fed.render())[1] == []  # told once per sample


async def test_a_family_typed_differently_by_another_worker_is_left_out_and_counted() -> None:
    fed = federation()
    fed.receive("w-1", "b", "local", MetricsSample(text="# TYPE depth gauge\ndepth 1\n"))
    fed.receive(
        "w-2", "a", "local", MetricsSample(text="# TYPE depth_total counter\ndepth_total 1\n")
    )
    series = parsed((await fed.render())[0])
    assert [s["worker"] for s, _ in series["depth"]] == ["b"]
    conflicts = {s["worker"]: v for s, v in series["modelrelay_worker_metrics_type_conflicts"]}
    assert conflicts == {"a": 1, "b": 0}


async def test_a_worker_named_to_sort_first_changes_nothing_of_what_an_earlier_worker_renders() -> (
    None
):
    alone = federation()
    alone.receive("w-1", "gpu-a", "local", MetricsSample(text=HONEST))
    honest = of_worker(exposition((await alone.render())[0]), "w-1")
    assert len(honest) == 22  # every series of both backends, the histogram's too
    fed = federation()
    fed.receive("w-1", "gpu-a", "local", MetricsSample(text=HONEST))
    fed.receive("w-2", "000-evil", "local", MetricsSample(text=HOSTILE))
    body, told = await fed.render()
    series = exposition(body)
    assert of_worker(series, "w-1") == honest
    # Of the hostile worker only the families that hold nobody else's names are
    # served, and the help text of the family both declare is the first one's.
    assert {s[0] for s in of_worker(series, "w-2")} == HOSTILE_SERVED
    [(worker_id, refusal)] = told
    assert worker_id == "w-2"
    assert refusal.reason.startswith(f"{HOSTILE_FAMILIES} of its families left out")
    assert "llamacpp:prompt_tokens (gauge)" in refusal.reason
    conflicts = {s[3]: s[4] for s in series if s[0].endswith("type_conflicts")}
    assert sorted(conflicts.values()) == [0, HOSTILE_FAMILIES]
    assert fed.rejected == 0  # the sample was not dropped, only those families
    # The next scrape of the same samples renders the same, and tells nobody again.
    again, told = await fed.render()
    assert of_worker(exposition(again), "w-1") == honest and told == []


async def test_the_family_declared_first_is_served_whichever_worker_sorts_first() -> None:
    fed = federation()
    fed.receive("w-1", "000-evil", "local", MetricsSample(text=HOSTILE))
    fed.receive("w-2", "gpu-a", "local", MetricsSample(text=HONEST))
    body, told = await fed.render()
    # Declared first, the other worker's families are served; the later ones left out.
    served = {s[0] for s in of_worker(exposition(body), "w-1")}
    assert "llamacpp:prompt_tokens" in served and len(served) == HOSTILE_FAMILIES + 2
    assert [w for w, _ in told] == ["w-2"]
    # When that worker leaves, the families it held go to the next one declaring them.
    fed.forget("w-1")
    alone = federation()
    alone.receive("w-2", "gpu-a", "local", MetricsSample(text=HONEST))
    series = exposition((await fed.render())[0])
    assert of_worker(series, "w-2") == of_worker(exposition((await alone.render())[0]), "w-2")


async def test_a_worker_there_first_cannot_take_a_family_over_by_declaring_it_later() -> None:
    fed = federation()
    fed.receive("w-1", "000-old", "local", MetricsSample(text="other 1\n"))
    fed.receive("w-2", "gpu-a", "local", MetricsSample(text="# TYPE depth gauge\ndepth 1\n"))
    assert {s[0] for s in of_worker(exposition((await fed.render())[0]), "w-2")} == {"depth"}
    # Its new sample declares the name with another type: later, so left out.
    fed.receive("w-1", "000-old", "local", MetricsSample(text="# TYPE depth counter\ndepth 2\n"))
    body, told = await fed.render()
    series = exposition(body)
    assert {s[0] for s in of_worker(series, "w-2")} == {"depth"}
    assert of_worker(series, "w-1") == set()
    assert [w for w, _ in told] == ["w-1"]


def test_a_new_rendering_process_serves_the_family_of_the_worker_that_began_first() -> None:
    federation_module._parsed.clear()  # what a rendering process started anew knows
    jobs = [
        Job("w-1", "000-late", "local", "# TYPE q counter\nq 1\n", 50.0, 99.0),
        Job("w-2", "box", "local", "# TYPE q gauge\nq 1\n", 10.0, 100.0),
    ]
    rendered = render_workers(jobs)
    assert rendered.left_out == {"w-1": ["q (counter)"]}
    assert [s[0] for s in exposition(rendered.body)] == ["q"]
    federation_module._parsed.clear()


async def test_a_quoted_name_the_exposition_would_write_escaped_does_not_parse() -> None:
    fed = federation()
    fed.receive("w-1", "gpu-a", "local", MetricsSample(text="# TYPE a_b gauge\na_b 1\n"))
    hostile = [
        '# TYPE "a.b" counter\n{"a.b"} 2\n',  # written as a_b_total, read back as a_b
        '{"x", "l.b"="1", l_b="2"} 1\n',  # one series with two labels named l_b
    ]
    for n, text in enumerate(hostile, start=2):
        fed.receive(f"w-{n}", f"000-{n}", "local", MetricsSample(text=text))
    body, told = await fed.render()
    assert sorted(w for w, _ in told) == ["w-2", "w-3"]
    assert all("not a name of the Prometheus text format" in r.reason for _, r in told)
    assert {s[0] for s in of_worker(exposition(body), "w-1")} == {"a_b"}


async def test_a_family_of_a_type_the_text_format_does_not_have_does_not_parse() -> None:
    fed = federation()
    for n, kind in enumerate(("info", "stateset", "gaugehistogram")):
        text = f"# TYPE x{n} {kind}\nx{n} 1\n"
        fed.receive(f"w-{n}", f"box-{n}", "local", MetricsSample(text=text))
    body, told = await fed.render()
    assert sorted(w for w, _ in told) == ["w-0", "w-1", "w-2"]
    assert all("does not parse" in refusal.reason for _, refusal in told)
    assert of_worker(exposition(body), "w-0") == set()


def test_samples_sent_faster_than_one_a_second_are_dropped_unread() -> None:
    now = [100.0]
    fed = Federation(1 << 20, 1000, clock=lambda: now[0], in_process=True)
    fed.receive("w-1", "box", "local", MetricsSample(text="q 1\n"))
    now[0] += 0.5
    assert fed.receive("w-1", "box", "local", MetricsSample(text="q 2\n")) is None
    assert fed.samples["w-1"].text == "q 1\n" and fed.rejected == 1
    now[0] += 0.6
    fed.receive("w-1", "box", "local", MetricsSample(text="q 3\n"))
    assert fed.samples["w-1"].text == "q 3\n"
    # Another worker is not held back by the first one's pace.
    fed.receive("w-2", "other", "local", MetricsSample(text="q 4\n"))
    assert fed.samples["w-2"].text == "q 4\n"


async def test_a_worker_family_named_like_the_relays_own_is_left_out() -> None:
    fed = federation()
    fed.receive("w-1", "box", "local", MetricsSample(text="modelrelay_worker_metrics_series 7\n"))
    series = parsed((await fed.render())[0])  # one valid exposition, no duplicate family
    assert [v for _, v in series["modelrelay_worker_metrics_series"]] == [1]


async def test_the_rendering_process_renders_what_the_thread_does() -> None:
    fed = Federation(1 << 20, 1000, clock=Clock())
    try:
        fed.receive("w-1", "box", "local", MetricsSample(text=LLAMA_SERVER))
        fed.receive("w-2", "bad", "local", MetricsSample(text='broken{x="} 1\n'))
        body, refusals = await fed.render()
        assert fed._executor is not None  # it really ran in another process
        again, _ = await fed.render()  # from that process's cache
    finally:
        fed.close()
    assert [w for w, _ in refusals] == ["w-2"]
    assert parsed(body)["llamacpp:kv_cache_usage_ratio"] == [
        ({"worker": "box", "worker_id": "w-1", "provider": "local"}, 0.25)
    ]
    assert (
        parsed(again)["llamacpp:kv_cache_usage_ratio"]
        == parsed(body)["llamacpp:kv_cache_usage_ratio"]
    )
