"""The .pth start-up hook and settings errors, in real interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

from click.testing import CliRunner


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    base.update(env)
    return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=120)


def test_hook_does_nothing_when_unset():
    proc = _python("import sys; print('warmstart' in sys.modules)")
    assert proc.stdout.strip() == "False" and proc.stderr == ""


def test_hook_activates_without_importing_torch():
    proc = _python("import os, sys; print('warmstart' in sys.modules, 'torch' in sys.modules, "
                   "os.environ['TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE'], os.environ['TORCH_COMPILE_JOB_ID'][:10])",
                   WARMSTART="1")
    assert proc.stdout.split() == ["True", "False", "1", "warmstart:"], proc.stderr


def test_hook_installs_torch_backends_on_import():
    proc = _python("import torch._inductor.remote_cache as rc; "
                   "print(rc.RemoteFxGraphCache.backend_override_cls.args, "
                   "rc.RemoteDynamoPGOCache.backend_override_cls.args)", WARMSTART="1")
    assert proc.stdout.strip() == "('fx_graph',) ('pgo',)", proc.stderr


def test_bad_setting_is_one_line_and_the_program_still_runs():
    proc = _python("print('ran')", WARMSTART="1", WARMSTART_CACHE_SIZE="lots")
    assert proc.stdout.strip() == "ran"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "WARMSTART_CACHE_SIZE='lots'" in lines[0] and "10GiB" in lines[0]


def test_enable_exports_settings_to_children(tmp_path):
    proc = _python(
        "import os, subprocess, sys, warmstart; warmstart.enable(cache_dir=%r, namespace='team-a'); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"WARMSTART\"], "
        "os.environ[\"WARMSTART_NAMESPACE\"], os.environ[\"WARMSTART_JOB_ID\"][:4])'], "
        "capture_output=True, text=True).stdout.strip())" % str(tmp_path))
    assert proc.stdout.strip() == "1 team-a job-", proc.stderr


def test_enable_rejects_bad_arguments_before_changing_anything():
    proc = _python("import os, warmstart\n"
                   "try:\n    warmstart.enable(mode='sometimes')\nexcept ValueError as e:\n    print(e)\n"
                   "print(os.environ.get('WARMSTART'))")
    out = proc.stdout.strip().splitlines()
    assert out[0] == "WARMSTART_CACHE_MODE='sometimes' is not valid: expected one of rw, ro, off"
    assert out[1] == "None"


def test_cli_bad_setting_exit_2(monkeypatch):
    from warmstart.cli import cli

    monkeypatch.setenv("WARMSTART_CACHE_URL", "http://cache:6379")
    result = CliRunner().invoke(cli, ["cache", "stats"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "warmstart: WARMSTART_CACHE_URL='http://cache:6379' is not valid: expected redis://[user:pass@]host:port[/db], "
        "rediss://... (TLS) or redis+cluster://host:port[,host:port...]"]
