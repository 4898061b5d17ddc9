"""The server's side of metrics federation (:mod:`relay.server.federation`), without a
socket: bounds, labels, merging across workers, and what a bad sample gets."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from relay.server.federation import Federation, count_series
from relay.wire.protocol import MetricsSample
from tests.fleet.backends import LLAMA_SERVER, VLLM


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
    fed.receive("w-1", "a", "local", MetricsSample(text="# TYPE depth gauge\ndepth 1\n"))
    fed.receive("w-2", "b", "local", MetricsSample(text="# TYPE depth counter\ndepth_total 1\n"))
    series = parsed((await fed.render())[0])
    assert [s["worker"] for s, _ in series["depth"]] == ["a"]
    assert series["modelrelay_worker_metrics_type_conflicts"][0][1] == 1


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
