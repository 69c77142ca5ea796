"""Settings.from_env: every variable of CONTRACT §2, and one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.config import Settings, parse_size
from warmstart.errors import ConfigError


def test_defaults():
    s = Settings.from_env({"HOME": "/home/u"})
    assert (s.enabled, s.cache_url, s.mode, s.secret, s.namespace) == (False, None, "rw", None, "")
    assert s.cache_dir == Path("/home/u/.cache/warmstart")
    assert s.cache_size == 10 * 1024**3


def test_xdg_cache_home_and_all_variables(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("abc\n")
    s = Settings.from_env({
        "WARMSTART": "1", "XDG_CACHE_HOME": "/xdg", "WARMSTART_CACHE_URL": "rediss://u:p@h:6380/2",
        "WARMSTART_CACHE_SIZE": "512MiB", "WARMSTART_CACHE_MODE": "ro", "WARMSTART_SECRET_FILE": str(secret),
        "WARMSTART_NAMESPACE": "team-a", "TORCHELASTIC_RUN_ID": "run7",
    })
    assert s.enabled and s.cache_dir == Path("/xdg/warmstart") and s.cache_size == 512 * 1024**2
    assert (s.mode, s.secret, s.namespace, s.job_id) == ("ro", b"abc", "team-a", "run7")
    assert s.run_dir == Path("warmstart-runs/run7")


@pytest.mark.parametrize("text,expected", [("10GiB", 10 * 1024**3), ("2GB", 2 * 10**9), ("1024", 1024),
                                           ("1.5M", int(1.5 * 1024**2)), ("64 kib", 64 * 1024)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("env,variable", [
    ({"WARMSTART_CACHE_SIZE": "big"}, "WARMSTART_CACHE_SIZE"),
    ({"WARMSTART_CACHE_SIZE": "0"}, "WARMSTART_CACHE_SIZE"),
    ({"WARMSTART_CACHE_MODE": "write"}, "WARMSTART_CACHE_MODE"),
    ({"WARMSTART_CACHE_URL": "http://h:1"}, "WARMSTART_CACHE_URL"),
    ({"WARMSTART_CACHE_URL": "redis://h:notaport"}, "WARMSTART_CACHE_URL"),
    ({"WARMSTART_CACHE_URL": "redis+cluster://a:1,:7000"}, "WARMSTART_CACHE_URL"),
    ({"WARMSTART": "yes"}, "WARMSTART"),
    ({"WARMSTART_SECRET_FILE": "/nonexistent/secret"}, "WARMSTART_SECRET_FILE"),
    ({"WARMSTART_NAMESPACE": "a b"}, "WARMSTART_NAMESPACE"),
])
def test_bad_values_name_variable_value_and_what_is_accepted(env, variable):
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{variable}=") and "expected" in message


def test_cluster_url_accepted():
    s = Settings.from_env({"WARMSTART_CACHE_URL": "redis+cluster://w:pw@10.0.0.1:7000,10.0.0.2:7001"})
    assert s.cache_url.startswith("redis+cluster://")


def test_torchrun_default_run_id_is_not_a_job_id():
    assert Settings.from_env({"TORCHELASTIC_RUN_ID": "none"}).job_id == ""
