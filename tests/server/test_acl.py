"""Access control on a real server: anonymous clients can do nothing, the reader only reads
warmstart's keys, the writer reads and writes them; both get an allow-list of exactly the commands
the store and the CLI send, nothing else."""

from __future__ import annotations

import os
import stat

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart.compile_cache import signing
from warmstart.compile_cache.remote import RemoteTier
from warmstart.server import KEY_PREFIX, Credentials
from warmstart.server.acl import CLUSTER_TOPOLOGY, CONNECTION, READ, WRITE


def _client(state, user: str | None, password: str | None = None) -> redis.Redis:
    creds = Credentials.load(state.options.dir)
    if user is not None and password is None:
        password = creds.passwords[user]
    return redis.Redis(
        port=state.options.port, username=user, password=password, socket_timeout=2, retry=Retry(NoBackoff(), 0)
    )


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
    assert reader.exists(key) == 1
    assert reader.strlen(key) == 7 and reader.getrange(key, 0, 2) == b"pay"
    for command in (
        ("SET", key, "evil"),
        ("SET", f"{KEY_PREFIX}new", "evil"),
        ("DEL", key),
        ("UNLINK", key),
        ("EXPIRE", key, "1"),
        ("APPEND", key, "x"),
        ("SETRANGE", key, "0", "x"),
        ("GETDEL", key),
        ("RENAME", key, f"{KEY_PREFIX}other"),
        ("FLUSHDB",),
        ("FLUSHALL",),
        # Reads the store does not need: no walking (or stalling) the key space.
        ("SCAN", "0", "COUNT", "100000000"),
        ("KEYS", "*"),
        ("RANDOMKEY",),
        ("DBSIZE",),
        ("LCS", key, key),
        ("SRANDMEMBER", key),
        ("HRANDFIELD", key),
        ("DUMP", key),
        ("OBJECT", "FREQ", key),
        ("MEMORY", "USAGE", key),
        ("TTL", key),
        ("TYPE", key),
        ("SUBSTR", key, "0", "1"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.execute_command(*command)
    admin = _client(single_server, "admin")
    assert admin.get(key) == b"payload"
    assert admin.ttl(key) == -1
    assert admin.exists(f"{KEY_PREFIX}new") == 0


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "maxmemory"),
        ("CONFIG", "SET", "maxmemory", "0"),
        ("SHUTDOWN", "NOSAVE"),
        ("KEYS", "*"),
        ("DEBUG", "SLEEP", "0"),
        ("MODULE", "LIST"),
        ("ACL", "SETUSER", "evil", "on", ">pw", "+@all", "~*"),
        ("ACL", "LIST"),
        ("EVAL", "return 1", "0"),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "ID", "1"),
        ("INFO",),
        ("SAVE",),
        ("BGSAVE",),
        ("BGREWRITEAOF",),
        ("SWAPDB", "0", "1"),
        ("REPLICAOF", "127.0.0.1", "1"),
        ("MIGRATE", "127.0.0.1", "1", "k", "0", "10"),
        ("RESTORE", f"{KEY_PREFIX}r", "0", "x"),
        ("SLOWLOG", "GET"),
        ("CLUSTER", "RESET"),
        ("FUNCTION", "LIST"),
        ("SCRIPT", "FLUSH"),
        ("PUBLISH", "channel", "message"),
        # Not administrative, but nothing the store sends: refused by the allow-list.
        ("LCS", f"{KEY_PREFIX}a", f"{KEY_PREFIX}b"),
        ("SETRANGE", f"{KEY_PREFIX}a", "1000000", "x"),
        ("SETBIT", f"{KEY_PREFIX}a", "4000000000", "1"),
        ("SRANDMEMBER", f"{KEY_PREFIX}s", "-100000000"),
        ("HRANDFIELD", f"{KEY_PREFIX}h", "-100000000"),
        ("APPEND", f"{KEY_PREFIX}a", "x"),
        ("RENAME", f"{KEY_PREFIX}a", f"{KEY_PREFIX}b"),
        ("EXPIRE", f"{KEY_PREFIX}a", "1"),
        ("GETDEL", f"{KEY_PREFIX}a"),
        ("SORT", f"{KEY_PREFIX}l"),
        ("RANDOMKEY",),
        ("DBSIZE",),
        ("TYPE", f"{KEY_PREFIX}a"),
        ("WATCH", "outside"),
        ("SELECT", "0"),
        ("MGET", f"{KEY_PREFIX}a", f"{KEY_PREFIX}b"),
        ("CLIENT", "SETNAME", "n"),
        # SCAN would show the writer every key name on the server, in one call of any COUNT.
        ("SCAN", "0", "COUNT", "100000000"),
        ("SCAN", "0", "MATCH", f"{KEY_PREFIX}*"),
        ("LPUSH", f"{KEY_PREFIX}l", "x"),
        ("XADD", f"{KEY_PREFIX}x", "*", "f", "v"),
        ("OBJECT", "ENCODING", f"{KEY_PREFIX}a"),
        ("MEMORY", "USAGE", f"{KEY_PREFIX}a"),
        ("DUMP", f"{KEY_PREFIX}a"),
        ("CLIENT", "KILL", "USER", "reader"),
        ("CLIENT", "NO-EVICT", "on"),
        ("WAIT", "0", "0"),
        ("LATENCY", "RESET"),
    ],
)
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
    assert reader.get("fx_graph", "k").value == value
    assert reader.put("fx_graph", "k2", b"from a reader") is False
    assert writer.get("fx_graph", "k2").value is None
    snapshot = reader.stats.to_dict()["remote"]["fx_graph"]
    assert snapshot["hits"] == 1 and snapshot["errors"] == 0


def test_secrets_are_private_and_acl_file_holds_no_clear_password(single_server):
    directory = single_server.options.dir
    creds = Credentials.load(directory)
    for name in (
        "admin.password",
        "writer.password",
        "reader.password",
        "secret.key",
        "signing.key",
        "users.acl",
        "writer.url",
        "reader.url",
        "node0/redis.conf",
        "state.json",
    ):
        mode = stat.S_IMODE((directory / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    # The public half is no secret: readable, and holding nothing private.
    assert stat.S_IMODE((directory / "verify.pub").stat().st_mode) == 0o644
    assert b"PRIVATE" not in (directory / "verify.pub").read_bytes()
    assert b"PRIVATE KEY" in (directory / "signing.key").read_bytes()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    acl = (directory / "users.acl").read_text()
    for password in creds.passwords.values():
        assert password not in acl
    assert "user default reset off" in acl


def test_generated_config_is_safe_by_default(single_server):
    conf = (single_server.options.dir / "node0" / "redis.conf").read_text().splitlines()
    for line in (
        "bind 127.0.0.1",
        "protected-mode yes",
        "maxmemory-policy allkeys-lru",
        'save ""',
        "appendonly no",
        f"maxmemory {32 * 1024**2}",
    ):
        assert line in conf
    admin = _client(single_server, "admin")
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert admin.config_get("appendonly") == {"appendonly": "no"}


def test_allow_lists_are_exactly_what_the_store_needs(single_server):
    """ACL DRYRUN: every listed command is allowed (so the lists load and mean what they say), and the
    reader gets none of the writer's extra ones."""
    admin = _client(single_server, "admin")
    k = f"{KEY_PREFIX}x"
    samples = {
        "get": ("GET", k),
        "exists": ("EXISTS", k),
        "strlen": ("STRLEN", k),
        "getrange": ("GETRANGE", k, "0", "1"),
        "set": ("SET", k, "v", "NX", "EX", "10"),
        "hlen": ("HLEN", k),
        "hkeys": ("HKEYS", k),
        "hgetall": ("HGETALL", k),
        "hset": ("HSET", k, "f", "v"),
        "hdel": ("HDEL", k, "f"),
        "unlink": ("UNLINK", k),
        "del": ("DEL", k),
        "sadd": ("SADD", k, "m"),
        "srem": ("SREM", k, "m"),
        "sscan": ("SSCAN", k, "0"),
        "ping": ("PING",),
        "hello": ("HELLO", "2"),
        "auth": ("AUTH", "u", "p"),
        "watch": ("WATCH", k),
        "unwatch": ("UNWATCH",),
        "multi": ("MULTI",),
        "exec": ("EXEC",),
        "discard": ("DISCARD",),
        "readonly": ("READONLY",),
        "asking": ("ASKING",),
        "command": ("COMMAND", "COUNT"),
        **{
            c: ("CLUSTER", c.split("|")[1].upper())
            for c in CLUSTER_TOPOLOGY
            if c.startswith("cluster|") and c != "cluster|keyslot"
        },
        "cluster|keyslot": ("CLUSTER", "KEYSLOT", k),
    }
    assert set(samples) == {*CONNECTION, *CLUSTER_TOPOLOGY, *READ, *WRITE}
    for name, command in samples.items():
        assert admin.execute_command("ACL", "DRYRUN", "writer", *command) == b"OK", name
        verdict = admin.execute_command("ACL", "DRYRUN", "reader", *command)
        assert (verdict == b"OK") == (name not in WRITE), (name, verdict)
    # The reader's key permission is read-only too, whatever the command.
    assert b"no permissions" in admin.execute_command("ACL", "DRYRUN", "reader", "SET", k, "v")
    assert b"no permissions" in admin.execute_command("ACL", "DRYRUN", "writer", "GET", "not-warmstart")


def test_store_full_path_with_writer_and_reader_credentials(single_server):
    """Everything the store and ``warmstart cache clear|doctor`` do works under the allow-lists:
    inline and chunked values, the repair path, key ids, delete, clear; the reader reads."""
    creds = Credentials.load(single_server.options.dir)
    ns = "acl-full"
    writer = RemoteTier(
        single_server.url("writer", creds),
        keys=signing.load_key_file(creds.signing_key_file),
        namespace=ns,
        chunk_bytes=64 * 1024,
    )
    reader = RemoteTier(
        single_server.url("reader", creds), keys=signing.load_key_file(creds.verify_key_file), namespace=ns
    )
    small, large = b"inline" * 100, os.urandom(300_000)  # incompressible: 5 chunks
    writer.ping()
    assert writer.put("fx_graph", "small", small) and writer.put("fx_graph", "large", large)
    admin = _client(single_server, "admin")
    blobs = list(admin.scan_iter(f"{KEY_PREFIX}{ns}:b:*"))
    assert len(blobs) == 5
    admin.delete(*blobs)
    assert reader.get("fx_graph", "large").value is None  # blob gone: a miss
    assert writer.put("fx_graph", "large", large)  # the pointer's blob was evicted: repaired
    # The same blob under another key finds its chunks there already and checks them: still a writer.
    assert writer.put("cpp_object", "same-bytes", large) and writer.put("fx_graph", "after", small)
    assert reader.get("cpp_object", "same-bytes").value == large
    for tier in (writer, reader):
        assert tier.get("fx_graph", "small").value == small and tier.get("fx_graph", "large").value == large
    assert writer.key_ids() == {writer.key_id: 4}
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.key_ids()  # the index is the writer's to walk
    assert writer.delete("fx_graph", "small") and reader.get("fx_graph", "small").value is None
    assert writer.clear() >= 4 and reader.get("fx_graph", "large").value is None
    for tier in (writer, reader):
        counts = tier.stats.to_dict()["remote"]["fx_graph"]
        assert counts["errors"] == 0 and counts["rejected"] == 0, counts


def test_verify_only_key_never_writes_even_with_the_writer_password(single_server):
    creds = Credentials.load(single_server.options.dir)
    tier = RemoteTier(
        single_server.url("writer", creds), keys=signing.load_key_file(creds.verify_key_file), namespace="verify-only"
    )
    assert not tier.keys.can_sign
    assert tier.put("fx_graph", "k", b"x" * 100) is False
    assert tier.put("fx_graph", "big", b"y" * 300_000) is False
    assert tier.stats.to_dict()["remote"]["fx_graph"]["dropped"] == 2
    assert list(_client(single_server, "admin").scan_iter(f"{KEY_PREFIX}verify-only:*")) == []


def test_writer_runs_compare_and_set_transactions_on_its_keys_only(single_server):
    """Lease renewal and release are WATCH/MULTI/EXEC transactions: the writer may run them on
    warmstart's keys; the reader, and keys outside the prefix, stay refused."""
    writer = _client(single_server, "writer")
    name = f"{KEY_PREFIX}cas-probe"
    writer.set(name, b"mine")
    with writer.pipeline(transaction=True) as pipe:
        pipe.watch(name)
        assert pipe.get(name) == b"mine"
        pipe.multi()
        pipe.set(name, b"renewed", xx=True, px=5000)
        pipe.execute()
    assert writer.get(name) == b"renewed"
    with pytest.raises(redis.ResponseError, match="no permissions"):
        writer.execute_command("WATCH", "outside")
    reader = _client(single_server, "reader")
    for command in (("MULTI",), ("WATCH", name), ("EXEC",)):
        with pytest.raises(redis.ResponseError, match="no permissions"):
            reader.execute_command(*command)
    writer.delete(name)


def test_clearing_with_reader_credentials_says_what_the_reader_may_do(single_server, tmp_path):
    """Redis's own refusal names a command (``no permissions to run the 'sscan' command``); the user
    needs to hear that this URL can only read, and which one can delete."""
    from click.testing import CliRunner

    from warmstart.cli import cli

    creds = Credentials.load(single_server.options.dir)
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": single_server.url("reader", creds),
        "WARMSTART_KEY_FILE": str(creds.signing_key_file),
        "WARMSTART_CACHE_DIR": str(tmp_path / "cache"),
    }
    result = CliRunner().invoke(cli, ["cache", "clear", "--remote"], env=env)
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert "the URL's user may not delete entries (a reader's URL can only read): use the writer URL" in line
    assert "no permissions" not in line and "scan" not in line


def test_doctor_with_reader_credentials_says_what_the_reader_may_do(single_server, tmp_path):
    """The documented reader setup (reader URL, public key): the entry count is not the reader's to
    take, which is no fault of the setup."""
    from click.testing import CliRunner

    from warmstart.cli import cli

    creds = Credentials.load(single_server.options.dir)
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": single_server.url("reader", creds),
        "WARMSTART_KEY_FILE": str(creds.verify_key_file),
        "WARMSTART_CACHE_DIR": str(tmp_path / "cache"),
        "WARMSTART_PRELOAD": "0",
    }
    result = CliRunner().invoke(cli, ["cache", "doctor"], env=env)
    # Each check with its lines wrapped to the width joined (indented under its text); a key pair's
    # count is "key in use".
    checks: list[str] = []
    for x in result.output.splitlines():
        if x.startswith("      ") and checks:
            checks[-1] += " " + x.strip()
        else:
            checks.append(x)
    line = next(x for x in checks if "key in use" in x)
    assert line.split()[0] == "ok", result.output
    assert "a reader" in line and "may read entries but not list them" in line
    assert "NoPermissionError" not in result.output
