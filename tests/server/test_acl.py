"""Access control on a real server: anonymous clients can do nothing, the reader only reads
warmstart's keys, the writer reads and writes them but runs no administrative command."""

from __future__ import annotations

import stat

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart.compile_cache.remote import RemoteTier
from warmstart.server import Credentials, KEY_PREFIX


def _client(state, user: str | None, password: str | None = None) -> redis.Redis:
    creds = Credentials.load(state.options.dir)
    if user is not None and password is None:
        password = creds.passwords[user]
    return redis.Redis(port=state.options.port, username=user, password=password, socket_timeout=2,
                       retry=Retry(NoBackoff(), 0))


def test_anonymous_client_cannot_read_or_write(single_server):
    _client(single_server, "writer").set(f"{KEY_PREFIX}anon-probe", b"x")
    anonymous = _client(single_server, None)
    for command in (("GET", f"{KEY_PREFIX}anon-probe"), ("SET", f"{KEY_PREFIX}x", "1"), ("KEYS", "*"), ("INFO",)):
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            anonymous.execute_command(*command)
    # The default user is off: it cannot even log in with an empty password.
    with pytest.raises(redis.AuthenticationError):
        _client(single_server, "default", "").ping()


def test_wrong_password_is_refused(single_server):
    with pytest.raises(redis.AuthenticationError):
        _client(single_server, "writer", "not-the-password").ping()


def test_reader_reads_but_cannot_write(single_server):
    writer, reader = _client(single_server, "writer"), _client(single_server, "reader")
    key = f"{KEY_PREFIX}reader-test"
    writer.set(key, b"payload")
    assert reader.get(key) == b"payload"
    assert reader.mget([key, key]) == [b"payload", b"payload"]
    assert reader.exists(key) == 1
    for command in (("SET", key, "evil"), ("DEL", key), ("UNLINK", key), ("EXPIRE", key, "1"), ("APPEND", key, "x"),
                    ("SETRANGE", key, "0", "x"), ("GETDEL", key), ("RENAME", key, f"{KEY_PREFIX}other"),
                    ("FLUSHDB",), ("FLUSHALL",)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.execute_command(*command)
    assert writer.get(key) == b"payload"
    assert writer.ttl(key) == -1


@pytest.mark.parametrize("command", [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "maxmemory"), ("CONFIG", "SET", "maxmemory", "0"),
    ("SHUTDOWN", "NOSAVE"), ("KEYS", "*"), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST"),
    ("ACL", "SETUSER", "evil", "on", ">pw", "+@all", "~*"), ("ACL", "LIST"), ("EVAL", "return 1", "0"),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"), ("INFO",), ("SAVE",), ("BGSAVE",), ("BGREWRITEAOF",),
    ("SWAPDB", "0", "1"), ("REPLICAOF", "127.0.0.1", "1"), ("MIGRATE", "127.0.0.1", "1", "k", "0", "10"),
    ("RESTORE", f"{KEY_PREFIX}r", "0", "x"), ("SLOWLOG", "GET"), ("CLUSTER", "RESET"), ("FUNCTION", "LIST"),
    ("SCRIPT", "FLUSH"), ("PUBLISH", "channel", "message"),
])
def test_writer_cannot_run_admin_commands(single_server, command):
    writer = _client(single_server, "writer")
    writer.set(f"{KEY_PREFIX}survivor", b"still here")
    # DEBUG and MODULE are also refused by Redis's own enable-*-command guard, which answers
    # first; ACL DRYRUN shows the ACL refuses them as well.
    with pytest.raises(redis.ResponseError, match="no permissions|not allowed"):
        writer.execute_command(*command)
    admin = _client(single_server, "admin")
    verdict = admin.execute_command("ACL", "DRYRUN", "writer", *command)
    assert b"no permissions" in verdict, verdict
    assert admin.ping()
    assert writer.get(f"{KEY_PREFIX}survivor") == b"still here"


def test_writer_and_reader_only_see_warmstart_keys(single_server):
    admin = _client(single_server, "admin")
    admin.set("not-warmstart", b"secret")
    for user in ("writer", "reader"):
        client = _client(single_server, user)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get("not-warmstart")
    with pytest.raises(redis.exceptions.NoPermissionError):
        _client(single_server, "writer").set("not-warmstart", b"overwritten")
    assert admin.get("not-warmstart") == b"secret"
    admin.delete("not-warmstart")


def test_store_writes_with_writer_url_and_reads_with_reader_url(single_server):
    creds = Credentials.load(single_server.options.dir)
    secret = creds.secret_file.read_bytes().strip()
    writer = RemoteTier(single_server.url("writer", creds), secret=secret, namespace="acl-test")
    reader = RemoteTier(single_server.url("reader", creds), secret=secret, namespace="acl-test")
    value = bytes(range(256)) * 400
    assert writer.put("fx_graph", "k", value)
    assert reader.get("fx_graph", "k") == value
    assert reader.put("fx_graph", "k2", b"from a reader") is False
    assert writer.get("fx_graph", "k2") is None
    snapshot = reader.stats.to_dict()["remote"]["fx_graph"]
    assert snapshot["hits"] == 1 and snapshot["errors"] == 0


def test_secrets_are_private_and_acl_file_holds_no_clear_password(single_server):
    directory = single_server.options.dir
    creds = Credentials.load(directory)
    for name in ("admin.password", "writer.password", "reader.password", "secret.key", "users.acl",
                 "writer.url", "reader.url", "node0/redis.conf"):
        mode = stat.S_IMODE((directory / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    acl = (directory / "users.acl").read_text()
    for password in creds.passwords.values():
        assert password not in acl
    assert "user default reset off" in acl


def test_generated_config_is_safe_by_default(single_server):
    conf = (single_server.options.dir / "node0" / "redis.conf").read_text().splitlines()
    for line in ("bind 127.0.0.1", "protected-mode yes", "maxmemory-policy allkeys-lru", 'save ""', "appendonly no",
                 f"maxmemory {32 * 1024**2}"):
        assert line in conf
    admin = _client(single_server, "admin")
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert admin.config_get("appendonly") == {"appendonly": "no"}
