"""Credentials of ``warmstart server start``: passwords and URLs only in 0600 files, never on stdout
unless asked (--show-secrets); an Ed25519 key pair made once and reused; jobs configured from the
files alone write with the private key and read with the public one; no password in error messages."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from _cli import passwords, run, start_json
from _redis import free_port_block

from warmstart.compile_cache import open_store, signing
from warmstart.compile_cache.remote import RemoteTier, connect
from warmstart.config import Settings
from warmstart.errors import ConfigError
from warmstart.server import Credentials


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_start_output_names_files_and_holds_no_password(server_dir):
    port = str(free_port_block(1))
    human = run("start", "--dir", str(server_dir), "--port", port, "--maxmemory", "16MiB")
    assert human.exit_code == 0, human.output
    secrets = passwords(server_dir)
    assert len(secrets) == 3 and all(s not in human.output for s in secrets)
    out = human.stdout
    for name in ("writer.url", "reader.url", "signing.key", "verify.pub"):
        assert str(server_dir / name) in out
    assert (
        f'WARMSTART_CACHE_URL="$(cat {server_dir / "writer.url"})" WARMSTART_KEY_FILE={server_dir / "signing.key"}'
        in out
    )
    assert (
        f'WARMSTART_CACHE_URL="$(cat {server_dir / "reader.url"})" WARMSTART_KEY_FILE={server_dir / "verify.pub"}'
        in out
    )
    assert "redis://" not in out
    for name in ("writer.url", "reader.url", "signing.key", *(f"{u}.password" for u in ("admin", "writer", "reader"))):
        assert _mode(server_dir / name) == 0o600, name
    assert run("stop", "--dir", str(server_dir)).exit_code == 0

    info = start_json("--dir", str(server_dir))  # asserts: no password in the output
    assert set(info) >= {"dir", "writer_url_file", "reader_url_file", "signing_key_file", "verify_key_file", "key_id"}
    assert info["key_id"] == signing.load_key_file(info["verify_key_file"]).key_id
    assert run("stop", "--dir", str(server_dir)).exit_code == 0

    shown = run("start", "--dir", str(server_dir), "--json", "--show-secrets")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    creds = Credentials.load(server_dir)
    assert creds.passwords["writer"] in data["writer_url"] and creds.passwords["reader"] in data["reader_url"]
    assert data["writer_url"] == (server_dir / "writer.url").read_text().strip()
    assert creds.passwords["admin"] not in shown.output  # never printed, not even when asked
    assert run("stop", "--dir", str(server_dir)).exit_code == 0
    shown = run("start", "--dir", str(server_dir), "--show-secrets")
    assert (
        shown.exit_code == 0 and creds.passwords["writer"] in shown.stdout and creds.passwords["reader"] in shown.stdout
    )


def test_key_pair_is_made_once_and_reused(server_dir):
    info = start_json("--dir", str(server_dir), "--port", str(free_port_block(1)))
    private = (server_dir / "signing.key").read_bytes()
    public = (server_dir / "verify.pub").read_bytes()
    assert _mode(server_dir / "signing.key") == 0o600 and _mode(server_dir / "verify.pub") == 0o644
    assert run("stop", "--dir", str(server_dir)).exit_code == 0
    (server_dir / "verify.pub").unlink()
    os.chmod(server_dir / "signing.key", 0o644)  # someone widened it
    again = start_json("--dir", str(server_dir))
    assert again["key_id"] == info["key_id"]
    assert (server_dir / "signing.key").read_bytes() == private and (server_dir / "verify.pub").read_bytes() == public
    assert _mode(server_dir / "signing.key") == 0o600


def test_unusable_signing_key_is_one_line_error(server_dir):
    server_dir.mkdir(parents=True, mode=0o700)
    (server_dir / "signing.key").write_text("not a key\n")
    result = run("start", "--dir", str(server_dir), "--port", str(free_port_block(1)))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "signing.key is not an Ed25519 private key" in lines[0]


def test_jobs_configured_from_the_files_write_and_read(server_dir, tmp_path):
    """The env lines `start` prints, as jobs would use them: the writer job (writer URL, signing.key)
    fills the cache; the reader job (reader URL, verify.pub) gets hits; a job with verify.pub and
    the *writer's* URL still writes nothing."""
    info = start_json("--dir", str(server_dir), "--port", str(free_port_block(1)))

    def store(url_file: str, key_file: str, name: str):
        env = {
            "WARMSTART": "1",
            "WARMSTART_CACHE_URL": open(url_file).read().strip(),
            "WARMSTART_KEY_FILE": key_file,
            "WARMSTART_CACHE_DIR": str(tmp_path / name),
            "WARMSTART_SECRET": "an-hmac-secret-the-key-file-overrides",
            "WARMSTART_NAMESPACE": "files",
        }
        return open_store(Settings.from_env(env), persist_stats=False)

    writer = store(info["writer_url_file"], info["signing_key_file"], "w")
    assert writer.remote.keys.scheme == "ed25519" and writer.remote.key_id == info["key_id"]
    big = os.urandom(200_000)
    writer.put("fx_graph", "small", b"s" * 500, sync=True)
    writer.put("fx_graph", "big", big, sync=True)
    reader = store(info["reader_url_file"], info["verify_key_file"], "r")
    assert reader.get("fx_graph", "small").value == b"s" * 500 and reader.get("fx_graph", "big").value == big
    assert reader.stats.get("remote", "fx_graph").hits == 2

    sneaky = store(info["writer_url_file"], info["verify_key_file"], "x")
    sneaky.put("fx_graph", "planted", b"p" * 500, sync=True)
    assert sneaky.flush(timeout=10)
    assert sneaky.stats.get("remote", "fx_graph").dropped == 1
    assert writer.remote.get("fx_graph", "planted").value is None
    assert writer.remote.key_ids() == {info["key_id"]: 2}


def test_rotate_key_pair(server_dir):
    info = start_json("--dir", str(server_dir), "--port", str(free_port_block(1)))
    old_reader_keys = signing.load_key_file(info["verify_key_file"])
    writer = RemoteTier(info["writer_url"], keys=signing.load_key_file(info["signing_key_file"]), namespace="rot")
    assert writer.put("fx_graph", "k", b"old" * 100)

    result = run("rotate", "--dir", str(server_dir), "--key-pair", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rotated_key_pair"] is True
    new_writer_keys = signing.load_key_file(info["signing_key_file"])
    new_reader_keys = signing.load_key_file(info["verify_key_file"])
    assert new_writer_keys.key_id == new_reader_keys.key_id != old_reader_keys.key_id
    # Readers on the new public key start a key space of their own; those still on the old one keep their hits.
    assert RemoteTier(info["reader_url"], keys=new_reader_keys, namespace="rot").get("fx_graph", "k").value is None
    assert (
        RemoteTier(info["reader_url"], keys=old_reader_keys, namespace="rot").get("fx_graph", "k").value == b"old" * 100
    )
    assert RemoteTier(info["writer_url"], keys=new_writer_keys, namespace="rot").put("fx_graph", "k", b"new" * 100)
    assert (
        RemoteTier(info["reader_url"], keys=new_reader_keys, namespace="rot").get("fx_graph", "k").value == b"new" * 100
    )


def test_passwords_stay_out_of_error_messages(server_dir, caplog):
    info = start_json("--dir", str(server_dir), "--port", str(free_port_block(1)))
    password = Credentials.load(server_dir).passwords["writer"]
    bad = info["writer_url"].replace("/0", "/not-a-db")
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env({"WARMSTART_CACHE_URL": bad})
    assert password not in str(excinfo.value) and "writer:***@" in str(excinfo.value)
    with pytest.raises(ConfigError) as excinfo:
        connect(info["writer_url"].replace(f":{info['nodes'][0]['port']}/", ":http/"))
    assert password not in str(excinfo.value)

    assert run("stop", "--dir", str(server_dir)).exit_code == 0  # now every connection fails
    caplog.set_level(logging.DEBUG, logger="warmstart")
    tier = RemoteTier(info["writer_url"], secret=b"s", namespace="down")
    assert tier.get("fx_graph", "k").value is None and tier.put("fx_graph", "k", b"v") is False
    assert caplog.records and all(password not in r.getMessage() for r in caplog.records)
