"""Running ``warmstart server start`` in tests: its JSON, with the URLs read from the 0600 files it
names (stdout carries no password unless ``--show-secrets``; every start here checks that)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from warmstart.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, ["server", *args])


def passwords(directory: Path) -> list[str]:
    return [p.read_text().strip() for p in sorted(Path(directory).glob("*.password"))]


def start_json(*args: str) -> dict:
    """``server start --json ARGS``; the result also holds ``writer_url``/``reader_url`` from the files."""
    result = run("start", "--json", *args)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    secrets = passwords(Path(info["dir"]))
    assert len(secrets) == 3
    for secret in secrets:
        assert secret not in result.output, "a password reached the output of `server start`"
    assert "writer_url" not in info and "reader_url" not in info
    info["writer_url"] = Path(info["writer_url_file"]).read_text().strip()
    info["reader_url"] = Path(info["reader_url_file"]).read_text().strip()
    return info
