"""Atomic writes of credential files: exact modes, and never through a file or link someone planted."""

from __future__ import annotations

import os
import stat

from warmstart._fileio import write_file, write_private


def test_the_file_gets_exactly_its_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_file(tmp_path / "verify.pub", b"public", 0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "verify.pub").st_mode) == 0o644
    write_private(tmp_path / "signing.key", "secret")
    assert stat.S_IMODE(os.stat(tmp_path / "signing.key").st_mode) == 0o600
    assert (tmp_path / "signing.key").read_text() == "secret"


def test_a_planted_temporary_name_or_link_is_never_written_through(tmp_path):
    """The old temporary name was predictable (``.NAME.<pid>.tmp``): another user could plant a link
    there pointing at a file of theirs, to be filled with the secret, or at one of ours, to be
    overwritten. Nothing outside the target is touched now, and no temporary file is left."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / f".signing.key.{os.getpid()}.tmp").symlink_to(victim)
    write_private(tmp_path / "signing.key", "secret")
    assert victim.read_text() == "keep"
    assert (tmp_path / "signing.key").read_text() == "secret" and not (tmp_path / "signing.key").is_symlink()
    leftovers = {p.name for p in tmp_path.iterdir()} - {"victim", "signing.key", f".signing.key.{os.getpid()}.tmp"}
    assert leftovers == set()
