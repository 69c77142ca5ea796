"""Ed25519 signing of remote entries (``WARMSTART_KEY_FILE``) next to the HMAC secret of older setups:
key files, record formats, and the store against a real redis-server (writers sign with the private
key, readers verify with the public key and never write; the two schemes never read each other)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import redis

from warmstart.compile_cache import ReadOnly, RemoteTier, open_store, signing
from warmstart.config import Settings
from warmstart.errors import ConfigError, IntegrityError

POINTER = signing.Pointer("ns", "fx_graph", "k", "", 5, 0, False, 1.5)


@pytest.fixture(scope="module")
def key_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    private, public = directory / "signing.key", directory / "verify.pub"
    signing.generate_key_pair(private, public)
    return private, public


def _verify(keys, record, key="k"):
    return keys.verify(record, namespace="ns", kind="fx_graph", key=key)


# -- keys and records -------------------------------------------------------------------------------


def test_generated_key_files(key_pair):
    private, public = key_pair
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    signer, verifier = signing.load_key_file(private), signing.load_key_file(public)
    assert signer.can_sign and not verifier.can_sign
    assert signer.scheme == verifier.scheme == "ed25519"
    assert signer.key_id == verifier.key_id and len(signer.key_id) == 8 and int(signer.key_id, 16) >= 0
    assert "PRIVATE" not in repr(signer) and signer.key_id in repr(verifier)


def test_sign_with_private_verify_with_public(key_pair):
    signer, verifier = (signing.load_key_file(p) for p in key_pair)
    record = signer.sign(POINTER, b"hello")
    assert record.startswith(signing.ED25519_MAGIC) and len(record) > 4 + 64
    assert _verify(verifier, record) == (POINTER, b"hello")
    assert _verify(signer, record) == (POINTER, b"hello")
    with pytest.raises(PermissionError):
        verifier.sign(POINTER, b"hello")


def test_tampered_or_replayed_records_are_rejected(key_pair):
    signer, verifier = (signing.load_key_file(p) for p in key_pair)
    record = bytearray(signer.sign(POINTER, b"hello"))
    for index in (5, 4 + 64 + 6, len(record) - 1):  # signature, header, inline value
        bad = bytearray(record)
        bad[index] ^= 0x01
        with pytest.raises(IntegrityError):
            _verify(verifier, bytes(bad))
    with pytest.raises(IntegrityError, match="another key"):
        _verify(verifier, bytes(record), key="other")
    with pytest.raises(IntegrityError):
        _verify(verifier, bytes(record[:40]))


def test_another_private_key_does_not_verify(key_pair):
    verifier = signing.load_key_file(key_pair[1])
    other = signing.Ed25519Keys.generate()
    assert other.key_id != verifier.key_id
    with pytest.raises(IntegrityError, match="does not verify"):
        _verify(verifier, other.sign(POINTER, b"hello"))


def test_a_record_of_the_other_scheme_is_rejected(key_pair):
    ed, hm = signing.load_key_file(key_pair[0]), signing.HmacKeys(b"secret")
    with pytest.raises(IntegrityError, match="HMAC-signed"):
        _verify(ed, hm.sign(POINTER, b"hello"))
    with pytest.raises(IntegrityError, match="Ed25519-signed"):
        _verify(hm, ed.sign(POINTER, b"hello"))
    assert _verify(hm, hm.sign(POINTER, b"hello")) == (POINTER, b"hello")
    assert hm.key_id == signing.key_id(b"secret")  # existing key ids (and entries) stay valid


def test_openssl_keys_load(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(private)], check=True, capture_output=True
    )
    subprocess.run(
        ["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)], check=True, capture_output=True
    )
    signer, verifier = signing.load_key_file(private), signing.load_key_file(public)
    assert signer.key_id == verifier.key_id
    assert _verify(verifier, signer.sign(POINTER, b"hello"))[1] == b"hello"


def _file(directory, name: str, content: str):
    path = directory / name
    path.write_text(content)
    return path


def _openssl(tmp_path, name: str, *args: str):
    path = tmp_path / name
    subprocess.run(["openssl", *args, "-out", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize(
    "make, found",
    [
        (lambda d: d / "missing.pem", "cannot be read"),
        (lambda d: _file(d, "empty", ""), "no PEM block"),
        (lambda d: _file(d, "text", "hello\nworld\n"), "no PEM block"),
        (
            lambda d: _openssl(d, "rsa.pem", "genpkey", "-algorithm", "rsa", "-pkeyopt", "rsa_keygen_bits:1024"),
            "RSA private key",
        ),
        (
            lambda d: _openssl(d, "enc.pem", "genpkey", "-algorithm", "ed25519", "-aes256", "-pass", "pass:x"),
            "encrypted",
        ),
        (
            lambda d: _file(d, "bad64", "-----BEGIN PRIVATE KEY-----\n!!!\n-----END PRIVATE KEY-----\n"),
            "not valid base64",
        ),
        (lambda d: _file(d, "cert", "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n"), "CERTIFICATE"),
        (lambda d: d, "cannot be read"),  # a directory
    ],
)
def test_malformed_key_file_is_one_line_config_error(tmp_path, make, found):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        signing.load_key_file(path)
    message = str(excinfo.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"WARMSTART_KEY_FILE={str(path)!r} is not valid")
    assert "Ed25519 private key" in message and "public key" in message and found in message


def test_settings_read_the_key_file_and_refuse_a_bad_one(tmp_path, key_pair):
    settings = Settings.from_env({"WARMSTART_KEY_FILE": str(key_pair[1]), "WARMSTART_SECRET": "s"})
    assert settings.key_file == key_pair[1] and settings.secret == b"s"
    for content in (None, "not a key", "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n"):
        path = tmp_path / "bad.pem"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        with pytest.raises(ConfigError) as excinfo:
            Settings.from_env({"WARMSTART_KEY_FILE": str(path)})
        assert len(str(excinfo.value).splitlines()) == 1 and "WARMSTART_KEY_FILE" in str(excinfo.value)
        assert str(path) in str(excinfo.value)


def test_enable_exports_key_file(monkeypatch, key_pair):
    import warmstart

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC"))}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(warmstart, "_activate", lambda pgo_job_id: None)
    warmstart.enable(key_file=key_pair[1], cache_url="redis://127.0.0.1:1/0")
    assert environ["WARMSTART_KEY_FILE"] == str(key_pair[1])
    assert Settings.from_env(environ).key_file == key_pair[1]


# -- the store against a real server ----------------------------------------------------------------


def _tier(url: str, keys, ns: str = "sig") -> RemoteTier:
    return RemoteTier(url, keys=keys, namespace=ns)


@pytest.mark.parametrize("size", [3000, 300_000], ids=["inline", "chunked"])
def test_writer_signs_and_reader_verifies(redis_node, key_pair, size):
    writer = _tier(redis_node.url, signing.load_key_file(key_pair[0]))
    reader = _tier(redis_node.url, signing.load_key_file(key_pair[1]))
    value = os.urandom(size)
    assert writer.put("fx_graph", "k", value, cost_s=2.0)
    assert reader.get("fx_graph", "k").value == value
    counts = reader.stats.get("remote", "fx_graph")
    assert (counts.hits, counts.rejected, counts.errors) == (1, 0, 0)
    client = redis.Redis.from_url(redis_node.url)
    assert client.get(writer._pointer_key("fx_graph", "k")).startswith(signing.ED25519_MAGIC)


def test_verify_only_job_never_writes(redis_node, key_pair, caplog):
    caplog.set_level("INFO", logger="warmstart")
    reader = _tier(redis_node.url, signing.load_key_file(key_pair[1]))  # the server lets anyone write
    assert reader.put("fx_graph", "small", b"x" * 100) is False
    assert reader.put("fx_graph", "large", os.urandom(200_000)) is False
    assert reader.stats.get("remote", "fx_graph").dropped == 2
    assert redis.Redis.from_url(redis_node.url).dbsize() == 0


def test_verify_only_key_makes_a_read_only_remote_tier(redis_node, key_pair, tmp_path, caplog):
    caplog.set_level("INFO", logger="warmstart")
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": redis_node.url,
        "WARMSTART_KEY_FILE": str(key_pair[1]),
        "WARMSTART_CACHE_DIR": str(tmp_path / "ro"),
    }
    store = open_store(Settings.from_env(env), persist_stats=False)
    assert isinstance(store.remote, ReadOnly) and not isinstance(store.local, ReadOnly)
    store.put("fx_graph", "k", b"x" * 5000, sync=True)
    assert redis.Redis.from_url(redis_node.url).dbsize() == 0
    assert store.local.get("fx_graph", "k").value == b"x" * 5000  # its own machine's tier still fills
    assert sum("can only verify" in r.getMessage() for r in caplog.records) == 1


def test_entry_signed_by_another_key_under_our_key_id_is_rejected(redis_node, key_pair):
    reader = _tier(redis_node.url, signing.load_key_file(key_pair[1]))
    forger = _tier(redis_node.url, signing.Ed25519Keys.generate())
    assert forger.put("fx_graph", "k", b"evil" * 1000)
    client = redis.Redis.from_url(redis_node.url)
    client.set(reader._pointer_key("fx_graph", "k"), client.get(forger._pointer_key("fx_graph", "k")))
    assert reader.get("fx_graph", "k").value is None
    counts = reader.stats.get("remote", "fx_graph")
    assert (counts.rejected, counts.hits) == (1, 0)
    # The rightful writer replaces the planted record instead of deferring to it.
    writer = _tier(redis_node.url, signing.load_key_file(key_pair[0]))
    assert writer.put("fx_graph", "k", b"good" * 1000)
    assert reader.get("fx_graph", "k").value == b"good" * 1000


def test_hmac_and_ed25519_jobs_keep_apart(redis_node, key_pair):
    ed_writer, ed_reader = (_tier(redis_node.url, signing.load_key_file(p)) for p in key_pair)
    hm = RemoteTier(redis_node.url, secret=b"team-secret", namespace="sig")  # the old shorthand
    assert hm.keys.scheme == "hmac-sha256" and hm.key_id == signing.key_id(b"team-secret")
    assert ed_writer.put("fx_graph", "ed", b"e" * 2000) and hm.put("fx_graph", "hm", b"h" * 2000)
    assert hm.get("fx_graph", "hm").value == b"h" * 2000 and ed_reader.get("fx_graph", "ed").value == b"e" * 2000
    assert (
        hm.get("fx_graph", "ed").value is None and ed_reader.get("fx_graph", "hm").value is None
    )  # misses, not rejections
    assert hm.stats.get("remote", "fx_graph").rejected == 0 == ed_reader.stats.get("remote", "fx_graph").rejected
    # Even a record planted under the other's key id is refused.
    client = redis.Redis.from_url(redis_node.url)
    client.set(ed_reader._pointer_key("fx_graph", "hm"), client.get(hm._pointer_key("fx_graph", "hm")))
    assert ed_reader.get("fx_graph", "hm").value is None and ed_reader.stats.get("remote", "fx_graph").rejected == 1
    # what writers stored, per key id (the namespace's index: a record planted beside it is not counted)
    assert ed_writer.key_ids() == {ed_writer.key_id: 1, hm.key_id: 1}


def test_remote_tier_takes_keys_or_secret():
    with pytest.raises(ValueError):
        RemoteTier("redis://127.0.0.1:1/0", namespace="n")
    with pytest.raises(ValueError):
        RemoteTier("redis://127.0.0.1:1/0", keys=signing.HmacKeys(b"a"), secret=b"b", namespace="n")


def test_open_store_prefers_the_key_file(redis_node, key_pair, tmp_path):
    base = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": redis_node.url,
        "WARMSTART_SECRET": "hmac",
        "WARMSTART_CACHE_DIR": str(tmp_path / "a"),
    }
    hmac_store = open_store(Settings.from_env(base), persist_stats=False)
    assert hmac_store.remote.keys.scheme == "hmac-sha256"
    ed_store = open_store(
        Settings.from_env(dict(base, WARMSTART_KEY_FILE=str(key_pair[1]), WARMSTART_CACHE_DIR=str(tmp_path / "b"))),
        persist_stats=False,
    )
    assert ed_store.remote.keys.scheme == "ed25519" and not ed_store.remote.keys.can_sign
    key_only = {k: v for k, v in base.items() if k != "WARMSTART_SECRET"}
    store = open_store(
        Settings.from_env(dict(key_only, WARMSTART_KEY_FILE=str(key_pair[0]), WARMSTART_CACHE_DIR=str(tmp_path / "c"))),
        persist_stats=False,
    )
    assert store.remote.keys.can_sign and store.remote.key_id == ed_store.remote.key_id
