"""Where the cluster's Redis is, as the settings say it (SPEC §20): one URL, or a master
found through Sentinel; contradictions refused with the settings' names."""

from __future__ import annotations

import pytest

from relay.server.cluster.redisconf import (
    MAX_SENTINELS,
    RedisTarget,
    TargetError,
    channel_hosts,
    parse_target,
)


def test_nothing_set_is_one_process_and_a_url_is_one_redis():
    assert parse_target() is None
    target = parse_target(url="redis://:secret@10.0.0.5:6380/2", timeout=0.5)
    assert target == RedisTarget(url="redis://:secret@10.0.0.5:6380/2", timeout=0.5)
    assert target.describe() == "redis://10.0.0.5:6380/2"  # never the password
    assert channel_hosts(target)[0]["address"] == target.url


def test_sentinels_name_the_master_for_every_use():
    listed = [f"10.0.0.{n}:26379" for n in range(1, MAX_SENTINELS + 1)]
    target = parse_target(sentinels=listed, master="modelrelay", password="p", tls=True)
    assert target is not None and target.through_sentinel
    assert target.sentinels[0] == ("10.0.0.1", 26379) and len(target.sentinels) == MAX_SENTINELS
    host = channel_hosts(target)[0]
    assert host["master_name"] == "modelrelay" and host["sentinels"] == list(target.sentinels)
    assert host["password"] == "p" and host["ssl"] is True
    assert host["sentinel_kwargs"]["socket_timeout"] == target.timeout
    assert "p" not in target.describe()
    ipv6 = parse_target(sentinels=["[::1]:26379"], master="m")
    assert ipv6 is not None and ipv6.sentinels == (("::1", 26379),)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"url": "redis://r:6379/0", "sentinels": ["s:26379"], "master": "m"}, "exclusive"),
        ({"url": "redis://r:6379/0", "master": "m"}, "exclusive"),
        ({"url": "redis://r:6379/0", "password": "p"}, "put them in the URL"),
        ({"sentinels": ["s:26379"]}, "REDIS_SENTINEL_MASTER must name"),
        ({"master": "m"}, "REDIS_SENTINELS must list"),
        ({"password": "p"}, "need REDIS_SENTINELS"),
        ({"sentinels": ["s"], "master": "m"}, "'s' is not host:port"),
        ({"sentinels": ["s:0"], "master": "m"}, "not host:port"),
        ({"sentinels": ["s:65536"], "master": "m"}, "not host:port"),
        ({"sentinels": ["s:\uff12\uff16\uff13\uff17\uff19"], "master": "m"}, "not host:port"),
        ({"sentinels": [f"s:{n}" for n in range(1, MAX_SENTINELS + 2)], "master": "m"}, "at most"),
    ],
)
def test_contradictions_are_refused_with_the_settings_names(settings, says):
    with pytest.raises(TargetError, match=says):
        parse_target(**settings)
