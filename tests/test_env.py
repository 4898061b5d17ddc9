"""Settings from the environment: typed, with defaults, loud on bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from modelrelay_site import env

ROOT = Path(__file__).resolve().parent.parent


def test_seconds_accept_decimals(monkeypatch):
    monkeypatch.setenv("X_SECS", "0.25")
    assert env.env_float("X_SECS", 30.0) == 0.25
    monkeypatch.delenv("X_SECS")
    assert env.env_float("X_SECS", 30.0) == 30.0


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_bad_seconds_are_rejected_with_the_variable_name(monkeypatch, value):
    monkeypatch.setenv("QUEUE_TIMEOUT_SECS", value)
    with pytest.raises(ImproperlyConfigured, match="QUEUE_TIMEOUT_SECS"):
        env.env_float("QUEUE_TIMEOUT_SECS", 30.0)


def test_ints_and_bools(monkeypatch):
    monkeypatch.setenv("N", "7")
    monkeypatch.setenv("B", "yes")
    assert env.env_int("N", 1) == 7
    assert env.env_bool("B", False) is True
    monkeypatch.setenv("N", "7.5")
    with pytest.raises(ImproperlyConfigured, match="N must be an integer"):
        env.env_int("N", 1)
    monkeypatch.setenv("B", "maybe")
    with pytest.raises(ImproperlyConfigured, match="B must be true or false"):
        env.env_bool("B", False)


def test_persisted_secret_is_generated_once(tmp_path):
    first = env.persisted_secret(tmp_path / "s", prefix="mrw_")
    assert first.startswith("mrw_") and len(first) > 30
    assert env.persisted_secret(tmp_path / "s") == first
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o600


def test_settings_refuse_a_bad_value_at_startup(tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "DATA_DIR": str(tmp_path), "MAX_QUEUE_LEN": "lots"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "MAX_QUEUE_LEN must be an integer, got 'lots'" in result.stderr
