"""The worker's settings (``relay.worker.config``): flags, then environment, then defaults."""

from __future__ import annotations

import pytest

from relay.worker.config import parse_config


def test_settings_come_from_flags_then_environment() -> None:
    env = {
        "PROXY_URL": "https://relay.example.com/base/",
        "WORKER_SECRET": "from-env",
        "PROVIDER_NAME": "gpu pool",
        "MODELS": " a, b,,a ",
        "MAX_CONCURRENT": "3",
    }
    cfg = parse_config([], env)
    assert cfg.connect_url == "wss://relay.example.com/base/v1/worker/connect?provider=gpu%20pool"
    assert cfg.worker_secret == "from-env"
    assert cfg.models == ("a", "b")
    assert cfg.max_concurrent == 3
    flagged = parse_config(["--worker-secret", "flag", "--max-concurrent", "5"], env)
    assert (flagged.worker_secret, flagged.max_concurrent) == ("flag", 5)
    assert parse_config([], {"WORKER_SECRET": "s"}).connect_url == (
        "ws://127.0.0.1:8080/v1/worker/connect?provider=local"
    )
    assert parse_config([], {"WORKER_SECRET": "s"}).models is None
    with pytest.raises(SystemExit) as missing:
        parse_config([], {})
    assert missing.value.code == 2
    with pytest.raises(SystemExit):
        parse_config(["--max-concurrent", "0"], {"WORKER_SECRET": "s"})


def test_the_server_silence_limit_takes_decimals_and_defaults_to_derived() -> None:
    assert parse_config([], {"WORKER_SECRET": "s"}).server_silence_secs == 0
    env = {"WORKER_SECRET": "s", "SERVER_SILENCE_SECS": "0.25"}
    assert parse_config([], env).server_silence_secs == 0.25
    assert parse_config(["--server-silence-secs", "90"], env).server_silence_secs == 90
    with pytest.raises(SystemExit):
        parse_config(["--server-silence-secs", "-1"], env)
