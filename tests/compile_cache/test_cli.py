"""``warmstart cache stats|doctor|clear`` against a real redis-server."""

from __future__ import annotations

import json

import redis
from _isolation import short_tmpdir
from _redis import closed_port_url
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.compile_cache import open_store
from warmstart.config import Settings


def _env(url: str, tmp_path, secret: str = "cli-secret") -> dict[str, str]:
    return {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": url,
        "WARMSTART_SECRET": secret,
        "WARMSTART_CACHE_DIR": str(tmp_path / "cache"),
        "WARMSTART_NAMESPACE": "cli",
    }


def _invoke(args: list[str], env: dict[str, str]):
    return CliRunner().invoke(cli, args, env=env)


def test_doctor_passes_and_leaves_nothing_behind(redis_node, tmp_path):
    result = _invoke(["cache", "doctor"], _env(redis_node.url, tmp_path))
    assert result.exit_code == 0, result.output
    for check in ("settings", "local tier", "secret", "namespace", "server", "round trip", "secret in use"):
        assert check in result.output
    assert list(redis.Redis.from_url(redis_node.url).scan_iter("ws:*")) == []


def test_doctor_reports_entries_signed_with_another_secret(redis_node, tmp_path):
    store = open_store(
        Settings.from_env(_env(redis_node.url, tmp_path / "a", secret="team-secret")), persist_stats=False
    )
    for i in range(3):
        store.put("fx_graph", f"k{i}", b"graph" * 100, sync=True)
    store.close()
    result = _invoke(["cache", "doctor"], _env(redis_node.url, tmp_path / "b", secret="a-wrong-secret"))
    assert result.exit_code == 0, result.output  # a warning, not a failure
    text = " ".join(result.output.split())
    assert "0 entries under this secret's key id" in text and "3 under other secrets" in text


def test_doctor_json_has_stable_keys_and_what_it_found(redis_node, tmp_path):
    result = _invoke(["cache", "doctor", "--json"], _env(redis_node.url, tmp_path))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert list(data) == ["ok", "checks", "namespace", "key_id", "key_id_entries", "other_key_ids"]
    assert data["ok"] is True
    assert all(set(c) == {"name", "status", "detail"} and c["status"] in ("ok", "warn", "fail") for c in data["checks"])
    assert {c["name"]: c["status"] for c in data["checks"]}["round trip"] == "ok"
    assert data["namespace"]["id"].startswith("v") and data["namespace"]["components"]["user"] == "cli"
    assert data["key_id"] and data["key_id_entries"] == 0 and data["other_key_ids"] == {}


def test_doctor_exit_codes_tell_a_failed_check_from_a_malformed_setting(tmp_path):
    down = _invoke(["cache", "doctor", "--json"], _env(closed_port_url(), tmp_path))
    assert down.exit_code == 1
    data = json.loads(down.stdout)
    assert data["ok"] is False and {c["name"]: c["status"] for c in data["checks"]}["server"] == "fail"
    malformed = _invoke(["cache", "doctor", "--json"], {**_env(closed_port_url(), tmp_path), "WARMSTART": "yes"})
    assert malformed.exit_code == 2
    checks = json.loads(malformed.stdout)["checks"]
    assert [(c["name"], c["status"]) for c in checks] == [("settings", "fail")] and "WARMSTART" in checks[0]["detail"]


def test_doctor_fails_naming_an_unreachable_server(tmp_path):
    result = _invoke(["cache", "doctor"], _env(closed_port_url(), tmp_path))
    assert result.exit_code == 1
    assert "cannot connect" in result.output


def test_stats_and_clear(redis_node, tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "runs"))  # this process's miss log, not ./warmstart-runs
    env = _env(redis_node.url, tmp_path)
    writer = open_store(Settings.from_env(env))
    writer.put("fx_graph", "k", b"graph" * 1000, sync=True)
    assert writer.get("fx_graph", "k").value == b"graph" * 1000
    assert writer.get("fx_graph", "missing").value is None
    writer.close()

    stats = json.loads(_invoke(["cache", "stats", "--json"], env).stdout)
    assert stats["local"]["entries"] == 1
    assert stats["tiers"]["local"]["fx_graph"]["hits"] == 1
    assert stats["tiers"]["remote"]["fx_graph"]["writes"] == 1
    human = _invoke(["cache", "stats"], env)
    assert human.exit_code == 0 and "fx graph" in human.output.lower()
    assert "round trips to the shared cache: " in human.output  # the lookups' own (no fetch ahead here)

    cleared = _invoke(["cache", "clear", "--local", "--remote"], env)
    assert cleared.exit_code == 0, cleared.output
    # the entry, and the manifest of this program's lookups (stored at close: it writes)
    assert "local: removed 1 entries" in cleared.output and "remote: removed 2 keys" in cleared.output
    assert json.loads(_invoke(["cache", "stats", "--json"], env).stdout)["local"]["entries"] == 0
    assert list(redis.Redis.from_url(redis_node.url).scan_iter("ws:*")) == []


def test_doctor_warns_when_tmpdir_is_too_long_for_dataloader_sockets(tmp_path):
    from warmstart.compile_cache.doctor_checks import AF_UNIX_PATH_MAX, MAX_TMPDIR_BYTES, longest_socket_path

    env = {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(tmp_path / "cache")}  # local tier only
    long_tmp = tmp_path / ("scheduler-given-" + "x" * max(1, 96 - len(str(tmp_path))))
    long_tmp.mkdir()
    assert len(str(long_tmp)) >= 90 and longest_socket_path(long_tmp) > AF_UNIX_PATH_MAX
    result = _invoke(["cache", "doctor"], {**env, "TMPDIR": str(long_tmp)})
    assert result.exit_code == 0, result.output  # a warning, not a failure
    text = " ".join(result.output.split())
    line = next(line for line in result.output.splitlines() if "TMPDIR" in line)
    assert line.lstrip().startswith("warn")
    assert f"is {len(str(long_tmp))} bytes" in text and f"up to {longest_socket_path(long_tmp)} bytes" in text
    assert f"{AF_UNIX_PATH_MAX}-byte AF_UNIX limit" in text and f"at most {MAX_TMPDIR_BYTES} bytes" in text

    short_tmp = short_tmpdir()  # short by construction, whatever pytest's base directory
    assert longest_socket_path(short_tmp) <= AF_UNIX_PATH_MAX
    result = _invoke(["cache", "doctor"], {**env, "TMPDIR": str(short_tmp)})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "TMPDIR" in line)
    assert line.lstrip().startswith("ok") and "too long" not in result.output


def test_clear_remote_with_a_verify_only_key_deletes_nothing(redis_node, tmp_path):
    """A job holding only the public key can never write: not by clearing either, whatever the URL."""
    from warmstart.compile_cache.signing import generate_key_pair

    generate_key_pair(tmp_path / "signing.key", tmp_path / "verify.pub")
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": redis_node.url,
        "WARMSTART_KEY_FILE": str(tmp_path / "signing.key"),
        "WARMSTART_CACHE_DIR": str(tmp_path / "cache"),
        "WARMSTART_NAMESPACE": "cli",
    }
    writer = open_store(Settings.from_env(env))
    writer.put("fx_graph", "k", b"graph", sync=True)
    writer.close()
    keys_before = sorted(redis.Redis.from_url(redis_node.url).scan_iter("ws:*"))
    assert keys_before

    refused = _invoke(
        ["cache", "clear", "--local", "--remote"], dict(env, WARMSTART_KEY_FILE=str(tmp_path / "verify.pub"))
    )
    assert refused.exit_code == 2, refused.output
    assert "is a public key, which can only read and verify" in refused.output
    assert sorted(redis.Redis.from_url(redis_node.url).scan_iter("ws:*")) == keys_before
    assert "local: removed" not in refused.output  # a refused command removes nothing, locally neither

    cleared = _invoke(["cache", "clear", "--remote"], env)
    assert cleared.exit_code == 0 and "remote: removed" in cleared.output, cleared.output
    assert list(redis.Redis.from_url(redis_node.url).scan_iter("ws:*:p:*")) == []


def test_doctor_with_a_url_of_another_scheme_says_so_in_one_message_and_exits_2(tmp_path):
    """Text the user gave ("[...]" in a URL's expected forms included) is printed as text, never read as markup."""
    env = {"WARMSTART": "1", "WARMSTART_CACHE_URL": "http://localhost:6379", "WARMSTART_CACHE_DIR": str(tmp_path)}
    result = _invoke(["cache", "doctor"], env)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and "MarkupError" not in result.output
    text = " ".join(result.output.split())
    assert text.startswith("FAIL settings: WARMSTART_CACHE_URL='http://localhost:6379' is not valid")
    assert "redis://[user:pass@]host:port[/db]" in text and text.count("FAIL") == 1


def _fits(output: str, width: int) -> bool:
    return max(len(line.rstrip()) for line in output.splitlines()) <= width


def test_stats_and_doctor_fit_the_width_they_are_given(redis_node, tmp_path, monkeypatch):
    """COLUMNS, or 80 columns when stdout is not a terminal: cells and lines wrap, nothing overflows."""
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "runs"))
    env = _env(redis_node.url, tmp_path / ("a-long-cache-directory-name-" + "x" * 40))
    store = open_store(Settings.from_env(env))
    for kind in ("cpp_object", "header_digest", "fx_graph"):
        store.put(kind, "k", b"x" * 123_456, sync=True, cost_s=12.5)
        store.get(kind, "k")
        store.get(kind, "missing")
    store.close()
    for columns, width in ((None, 80), ("80", 80), ("60", 60)):
        with_columns = {**env, "COLUMNS": columns} if columns else {k: v for k, v in env.items() if k != "COLUMNS"}
        stats = _invoke(["cache", "stats"], with_columns)
        assert stats.exit_code == 0, stats.output
        assert _fits(stats.output, width), stats.output
        if width == 80:  # cells wrap at spaces, words stay whole
            assert {"preprocessed", "header", "digest", "compiled", "C++", "object"} <= set(stats.output.split())
        doctor = _invoke(["cache", "doctor"], with_columns)
        assert doctor.exit_code == 0, doctor.output
        assert _fits(doctor.output, width) or all(
            len(line) <= width or " " not in line.strip() for line in doctor.output.splitlines()
        ), doctor.output
    wide = _invoke(["cache", "stats"], {**env, "COLUMNS": "200"})
    assert any(len(line.rstrip()) > 80 for line in wide.output.splitlines())  # a wide terminal gets one line per row


def test_doctor_with_a_key_pair_speaks_of_keys_not_secrets(redis_node, tmp_path):
    from warmstart.compile_cache.signing import generate_key_pair

    generate_key_pair(tmp_path / "old.key", tmp_path / "old.pub")
    generate_key_pair(tmp_path / "signing.key", tmp_path / "verify.pub")
    env = {**_env(redis_node.url, tmp_path / "a"), "WARMSTART_KEY_FILE": str(tmp_path / "old.key")}
    del env["WARMSTART_SECRET"]
    old = open_store(Settings.from_env(env), persist_stats=False)
    old.put("fx_graph", "k", b"graph", sync=True)
    old.close()
    result = _invoke(["cache", "doctor"], {**env, "WARMSTART_KEY_FILE": str(tmp_path / "signing.key")})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "key in use" in text and "1 under other keys" in text and "signing.key" in text
    assert "secret" not in text.lower(), result.output


def test_stats_counts_a_nested_hit_once_in_the_wall_time_saved(tmp_path, monkeypatch):
    """An AOTAutograd entry's compile time includes its FX graph's, which includes its C++ object's:
    the per-kind column sums all three, the wall time saved counts the outermost one."""
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "runs"))
    env = {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(tmp_path / "cache")}
    store = open_store(Settings.from_env(env))
    for kind, cost in (("aot_autograd", 20.0), ("fx_graph", 15.0), ("cpp_object", 10.0), ("pgo", 1.0)):
        store.put(kind, "k", b"x" * 100, sync=True, cost_s=cost)
        assert store.get(kind, "k").value is not None
    store.close()
    data = json.loads(_invoke(["cache", "stats", "--json"], env).stdout)
    per_kind = sum(c["saved_s"] for c in data["tiers"]["local"].values())
    assert per_kind == data["totals"]["local"]["saved_s"] and 45.9 < per_kind <= 46.0
    assert 20.9 < data["totals"]["local"]["saved_wall_s"] <= 21.0  # aot autograd's and pgo's
    text = " ".join(_invoke(["cache", "stats"], env).output.split())
    assert "so the column adds up to more than the time saved" in text
    assert f"local {data['totals']['local']['saved_wall_s']:.1f} s" in text
