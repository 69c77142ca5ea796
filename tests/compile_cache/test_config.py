"""Settings.from_env: every variable of docs/reference.md#environment, and one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.config import (
    ENABLE_VARIABLES,
    JobIdentity,
    ServerSettings,
    Settings,
    enable_environment,
    job_identity,
    parse_size,
    quiet_errors,
    server_settings,
)
from warmstart.errors import ConfigError


def test_defaults():
    s = Settings.from_env({"HOME": "/home/u"})
    assert (s.enabled, s.cache_url, s.mode, s.secret, s.namespace) == (False, None, "rw", None, "")
    assert s.cache_dir == Path("/home/u/.cache/warmstart")
    assert s.cache_size == 10 * 1024**3


def test_xdg_cache_home_and_all_variables(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("abc\n")
    s = Settings.from_env(
        {
            "WARMSTART": "1",
            "XDG_CACHE_HOME": "/xdg",
            "WARMSTART_CACHE_URL": "rediss://u:p@h:6380/2",
            "WARMSTART_CACHE_SIZE": "512MiB",
            "WARMSTART_CACHE_MODE": "ro",
            "WARMSTART_SECRET_FILE": str(secret),
            "WARMSTART_NAMESPACE": "team-a",
            "TORCHELASTIC_RUN_ID": "run7",
        }
    )
    assert s.enabled and s.cache_dir == Path("/xdg/warmstart") and s.cache_size == 512 * 1024**2
    assert (s.mode, s.secret, s.namespace, s.job.job_id) == ("ro", b"abc", "team-a", "run7")
    assert s.job.run_dir is None  # unset: the recorder chooses warmstart-runs/<job id>


@pytest.mark.parametrize(
    "text,expected",
    [("10GiB", 10 * 1024**3), ("2GB", 2 * 10**9), ("1024", 1024), ("1.5M", int(1.5 * 1024**2)), ("64 kib", 64 * 1024)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "env,variable",
    [
        ({"WARMSTART_CACHE_SIZE": "big"}, "WARMSTART_CACHE_SIZE"),
        ({"WARMSTART_CACHE_SIZE": "0"}, "WARMSTART_CACHE_SIZE"),
        ({"WARMSTART_CACHE_MODE": "write"}, "WARMSTART_CACHE_MODE"),
        ({"WARMSTART_CACHE_URL": "http://h:1"}, "WARMSTART_CACHE_URL"),
        ({"WARMSTART_CACHE_URL": "redis://h:notaport"}, "WARMSTART_CACHE_URL"),
        ({"WARMSTART_CACHE_URL": "redis+cluster://a:1,:7000"}, "WARMSTART_CACHE_URL"),
        ({"WARMSTART": "yes"}, "WARMSTART"),
        ({"WARMSTART_SECRET_FILE": "/nonexistent/secret"}, "WARMSTART_SECRET_FILE"),
        ({"WARMSTART_NAMESPACE": "a b"}, "WARMSTART_NAMESPACE"),
        ({"WARMSTART_DYNAMO": "off"}, "WARMSTART_DYNAMO"),
        ({"WARMSTART_MAX_WAIT_S": "soon"}, "WARMSTART_MAX_WAIT_S"),
        ({"WARMSTART_MAX_WAIT_S": "-1"}, "WARMSTART_MAX_WAIT_S"),
    ],
)
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
    assert Settings.from_env({"TORCHELASTIC_RUN_ID": "none"}).job.job_id == ""
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}).job_id == ""


def test_job_identity_defaults():
    job = job_identity({})
    assert job == JobIdentity(enabled=False, job_id="", run_dir=None, rank=0, attempt=0, quiet_errors=False)


def test_job_identity_from_warmstart_variables():
    job = job_identity(
        {
            "WARMSTART": "1",
            "WARMSTART_JOB_ID": "run-7",
            "TORCHELASTIC_RUN_ID": "elastic-1",
            "WARMSTART_RUN_DIR": " runs/a ",
            "RANK": "3",
            "WARMSTART_ATTEMPT": "2",
            "TORCHELASTIC_RESTART_COUNT": "5",
            "WARMSTART_QUIET_ERRORS": "1",
        }
    )
    assert (job.enabled, job.job_id, job.given_job_id, job.run_dir) == (True, "run-7", "run-7", Path("runs/a"))
    assert (job.rank, job.attempt, job.quiet_errors) == (3, 2, True)


def test_job_identity_falls_back_to_torchrun():
    job = job_identity({"TORCHELASTIC_RUN_ID": "elastic-1", "TORCHELASTIC_RESTART_COUNT": "4"})
    # torchrun's run id is new on every launch: it names the job's events, never its PGO state
    assert (job.job_id, job.given_job_id, job.attempt) == ("elastic-1", "", 4)


@pytest.mark.parametrize(
    "env,variable",
    [
        ({"RANK": "zero"}, "RANK"),
        ({"RANK": "-2"}, "RANK"),
        ({"WARMSTART_ATTEMPT": "first"}, "WARMSTART_ATTEMPT"),
        ({"WARMSTART_ATTEMPT": "-1"}, "WARMSTART_ATTEMPT"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT"),
    ],
)
def test_bad_job_identity_is_one_line(env, variable):
    for parse in (job_identity, Settings.from_env):
        with pytest.raises(ConfigError) as info:
            parse(env)
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"{variable}={env[variable]!r}") and "expected" in message


def test_quiet_errors_never_raises():
    assert quiet_errors({"WARMSTART_QUIET_ERRORS": "1", "RANK": "zero"}) is True
    assert quiet_errors({}) is False


def test_server_settings(tmp_path):
    home = {"HOME": "/home/u"}
    assert server_settings(home) == ServerSettings(Path("/home/u/.local/state/warmstart/server"), None, None)
    assert server_settings({**home, "XDG_STATE_HOME": "/xdg"}).dir == Path("/xdg/warmstart/server")
    s = server_settings(
        {
            **home,
            "WARMSTART_SERVER_DIR": "~/srv",
            "WARMSTART_REDIS_SERVER": " /opt/redis-server ",
            "WARMSTART_REDIS_CLI": "redis-cli7",
        }
    )
    assert (s.dir, s.redis_server, s.redis_cli) == (Path("~/srv").expanduser(), "/opt/redis-server", "redis-cli7")
    assert server_settings({**home, "WARMSTART_REDIS_SERVER": "  "}).redis_server is None


def test_enable_environment_sets_the_variables_of_given_arguments(tmp_path):
    base = {"HOME": "/home/u", "WARMSTART_NAMESPACE": "from-env", "WARMSTART_CACHE_MODE": "ro"}
    env = enable_environment(base, cache_dir=tmp_path, namespace="team-a", secret="s3", job_id="run-7", mode=None)
    assert env["WARMSTART"] == "1" and env["WARMSTART_CACHE_DIR"] == str(tmp_path)
    assert (env["WARMSTART_NAMESPACE"], env["WARMSTART_SECRET"], env["WARMSTART_JOB_ID"]) == ("team-a", "s3", "run-7")
    assert env["WARMSTART_CACHE_MODE"] == "ro"  # None: the environment's value stays
    assert base == {"HOME": "/home/u", "WARMSTART_NAMESPACE": "from-env", "WARMSTART_CACHE_MODE": "ro"}


@pytest.mark.parametrize("raw,on", [("", False), ("1", True), (" 1 ", True), ("0", False), (" 0 ", False)])
def test_dynamo_frames_switch(raw, on):
    assert Settings.from_env({"WARMSTART_DYNAMO": raw}).dynamo_frames is on
    assert enable_environment({}, dynamo=int(on))["WARMSTART_DYNAMO"] == str(int(on))


def test_every_enable_argument_has_a_variable():
    import inspect

    import warmstart

    assert set(inspect.signature(warmstart.enable).parameters) == set(ENABLE_VARIABLES)


@pytest.mark.parametrize(
    "given,env,variable",
    [
        ({"mode": "sometimes"}, {}, "WARMSTART_CACHE_MODE"),
        ({"cache_size": "lots"}, {}, "WARMSTART_CACHE_SIZE"),
        ({}, {"RANK": "zero"}, "RANK"),
        ({}, {"WARMSTART_ATTEMPT": "first"}, "WARMSTART_ATTEMPT"),
    ],
)
def test_enable_environment_checks_everything(given, env, variable):
    with pytest.raises(ConfigError) as info:
        enable_environment(env, **given)
    assert str(info.value).startswith(f"{variable}=") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "option,value",
    [
        ("socket_timeout", "abc"),
        ("socket_timeout", "0"),
        ("socket_connect_timeout", "-1"),
        ("ssl_cert_reqs", "always"),
        ("ssl_check_hostname", "maybe"),
        ("ssl_ca_certs", ""),
    ],
)
def test_bad_url_option_is_one_line_naming_variable_value_and_what_is_accepted(option, value):
    url = f"redis://writer:hunter2@cache:6379/0?{option}={value}"
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART_CACHE_URL": url})
    message = str(info.value)
    assert "\n" not in message and "hunter2" not in message
    assert message.startswith(f"WARMSTART_CACHE_URL option {option}={value!r}") and "expected" in message


def test_unknown_url_option_names_the_accepted_ones():
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART_CACHE_URL": "redis://cache:6379/0?sockettimeout=1"})
    message = str(info.value)
    assert "'sockettimeout'" in message and "socket_timeout" in message and "\n" not in message


def test_good_url_options_are_accepted():
    url = (
        "rediss://w:p@cache:6380/0?socket_timeout=1.5&socket_connect_timeout=0.2&ssl_cert_reqs=required"
        "&ssl_check_hostname=false&ssl_ca_certs=/etc/ca.pem&compress=off"
    )
    assert Settings.from_env({"WARMSTART_CACHE_URL": url}).cache_url == url


@pytest.mark.parametrize(
    "url",
    [
        "redis://writer:hunter2@cache:notaport/0",
        "http://writer:hunter2@cache:1",
        "redis+cluster://writer:hunter2@a:1,:7000",
    ],
)
def test_url_errors_never_echo_the_password(url):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART_CACHE_URL": url})
    assert "hunter2" not in str(info.value) and "writer:***@" in str(info.value)


def test_redact_url():
    from warmstart.config import redact_url

    assert redact_url("redis://u:pw@h:1/0?compress=off") == "redis://u:***@h:1/0?compress=off"
    assert redact_url("redis+cluster://u:p%40w@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize("raw,shared", [("", False), ("0", False), ("1", True)])
def test_cache_dir_shared(raw, shared):
    env = {"WARMSTART_CACHE_DIR_SHARED": raw} if raw else {}
    assert Settings.from_env(env).cache_dir_shared is shared


def test_bad_cache_dir_shared_is_one_line():
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART_CACHE_DIR_SHARED": "yes"})
    message = str(info.value)
    assert message.startswith("WARMSTART_CACHE_DIR_SHARED='yes'") and "expected" in message and "\n" not in message


def test_metrics_settings():
    from warmstart.config import MetricsSettings, metrics_settings

    assert metrics_settings({}) == MetricsSettings() and not MetricsSettings().on
    s = metrics_settings(
        {
            "WARMSTART_METRICS_PORT": "9400",
            "WARMSTART_METRICS_TEXTFILE": " /var/lib/ne/ws.prom ",
            "WARMSTART_METRICS_RANKS": "ALL",
            "WARMSTART_METRICS_INTERVAL_S": "2.5",
            "LOCAL_RANK": "3",
        }
    )
    assert s == MetricsSettings(
        port=9400, textfile=Path("/var/lib/ne/ws.prom"), all_ranks=True, interval_s=2.5, local_rank=3
    )
    assert s.on and metrics_settings({"WARMSTART_METRICS_PORT": "0"}).port is None  # 0: off


@pytest.mark.parametrize(
    "env,variable",
    [
        ({"WARMSTART_METRICS_PORT": "http"}, "WARMSTART_METRICS_PORT"),
        ({"WARMSTART_METRICS_PORT": "70000"}, "WARMSTART_METRICS_PORT"),
        ({"WARMSTART_METRICS_PORT": "-1"}, "WARMSTART_METRICS_PORT"),
        ({"WARMSTART_METRICS_TEXTFILE": "/tmp/metrics.txt"}, "WARMSTART_METRICS_TEXTFILE"),
        ({"WARMSTART_METRICS_RANKS": "1"}, "WARMSTART_METRICS_RANKS"),
        ({"WARMSTART_METRICS_INTERVAL_S": "0"}, "WARMSTART_METRICS_INTERVAL_S"),
        ({"WARMSTART_METRICS_INTERVAL_S": "often"}, "WARMSTART_METRICS_INTERVAL_S"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK"),
    ],
)
def test_bad_metrics_settings_are_one_line(env, variable):
    from warmstart.config import metrics_settings

    with pytest.raises(ConfigError) as info:
        metrics_settings(env)
    message = str(info.value)
    assert message.startswith(f"{variable}={env[variable]!r}") and "expected" in message and "\n" not in message


def test_a_question_mark_in_the_password_is_never_echoed():
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"WARMSTART_CACHE_URL": "redis://user:6379?s3cret=1@host/0"})
    message = str(raised.value)
    assert "s3cret" not in message and "6379?" not in message
    assert "percent-encoded (%3F, %23)" in message


def test_the_wait_budget_is_a_setting_of_its_own():
    assert Settings.from_env({}).max_wait_s == 60.0
    assert Settings.from_env({"WARMSTART_MAX_WAIT_S": "2.5"}).max_wait_s == 2.5
    assert Settings.from_env({"WARMSTART_MAX_WAIT_S": "0"}).max_wait_s == 0.0
    assert enable_environment({}, max_wait_s=5)["WARMSTART_MAX_WAIT_S"] == "5"
