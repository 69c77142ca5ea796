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


def test_hook_does_nothing_when_zero_or_empty():
    for value in ("0", ""):
        proc = _python("import sys; print('warmstart' in sys.modules)", WARMSTART=value)
        assert proc.stdout.strip() == "False" and proc.stderr == "", value


def test_a_value_other_than_one_or_zero_is_said_and_leaves_warmstart_off():
    # "true" or "yes" read as "on" to a person: silence would leave the job uncached without a word.
    for value in ("true", "yes", "2"):
        proc = _python("import os; print('ran', os.environ.get('TORCH_COMPILE_JOB_ID'))", WARMSTART=value)
        assert proc.stdout.split() == ["ran", "None"], proc.stderr
        lines = proc.stderr.strip().splitlines()
        said = f"WARMSTART={value!r} is not valid: expected 1 (on), 0 or unset (off)"
        assert lines == [f"warmstart: disabled in this process: {said}"]


def test_hook_activates_without_importing_torch():
    # torch's remote-cache switches are never exported (children without warmstart would inherit them):
    # they are set in torch's config when it is imported.
    proc = _python(
        "import os, sys; print('warmstart' in sys.modules, 'torch' in sys.modules, "
        "os.environ.get('TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE'), os.environ['TORCH_COMPILE_JOB_ID'][:10])",
        WARMSTART="1",
    )
    assert proc.stdout.split() == ["True", "False", "None", "warmstart:"], proc.stderr


def test_hook_installs_torch_backends_on_import():
    proc = _python(
        "import torch._inductor.remote_cache as rc; "
        "print(rc.RemoteFxGraphCache.backend_override_cls.args, "
        "rc.RemoteDynamoPGOCache.backend_override_cls.args)",
        WARMSTART="1",
    )
    assert proc.stdout.strip() == "('fx_graph',) ('pgo',)", proc.stderr


def test_bad_setting_is_one_line_and_the_program_still_runs():
    proc = _python("print('ran')", WARMSTART="1", WARMSTART_CACHE_SIZE="lots")
    assert proc.stdout.strip() == "ran"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "WARMSTART_CACHE_SIZE='lots'" in lines[0] and "10GiB" in lines[0]


def test_bad_job_identity_is_said_once_per_job():
    # A bad RANK fails the job identity itself: whether to stay quiet must not depend on parsing it.
    proc = _python(
        "import subprocess, sys; print('ran', flush=True); subprocess.run([sys.executable, '-c', 'print(1)'])",
        WARMSTART="1",
        RANK="zero",
    )
    assert proc.stdout.split() == ["ran", "1"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "RANK='zero'" in lines[0], proc.stderr


def test_enable_keeps_torchruns_run_id_out_of_the_pgo_job_id():
    proc = _python(
        "import os, warmstart; warmstart.enable(); "
        "print(os.environ.get('WARMSTART_JOB_ID'), os.environ['TORCH_COMPILE_JOB_ID'])",
        TORCHELASTIC_RUN_ID="elastic-1",
    )
    job_id, pgo = proc.stdout.split()
    assert job_id == "None" and pgo.startswith("warmstart:") and pgo != "warmstart:elastic-1", proc.stderr
    proc = _python("import os, warmstart; warmstart.enable(job_id='run-7'); print(os.environ['TORCH_COMPILE_JOB_ID'])")
    assert proc.stdout.strip() == "warmstart:run-7", proc.stderr


_IMPORT_HOOKS = """
import sys
from warmstart.compile_cache import import_hooks
import_hooks.on_import("json", lambda m: print("already", m.__name__))
import_hooks.on_import("wave", lambda m: print("hooked", m.__name__, hasattr(m, "open")))
import_hooks.on_import("colorsys", lambda m: 1 / 0)
import json
import_hooks.install()
import_hooks.install()  # once per process
import wave, colorsys
print("imported", colorsys.__name__)
"""


def test_import_hooks_run_once_after_the_import_and_never_break_it():
    proc = _python(_IMPORT_HOOKS)
    assert proc.stdout.splitlines() == ["already json", "hooked wave True", "imported colorsys"], proc.stderr
    assert "could not hook colorsys (ZeroDivisionError" in proc.stderr


def test_enable_exports_settings_to_children(tmp_path):
    proc = _python(
        f"import os, subprocess, sys, warmstart; warmstart.enable(cache_dir={str(tmp_path)!r}, namespace='team-a'); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"WARMSTART\"], "
        'os.environ["WARMSTART_NAMESPACE"], os.environ["WARMSTART_JOB_ID"][:4])\'], '
        "capture_output=True, text=True).stdout.strip())"
    )
    assert proc.stdout.strip() == "1 team-a job-", proc.stderr


def test_enable_rejects_bad_arguments_before_changing_anything():
    proc = _python(
        "import os, warmstart\n"
        "try:\n    warmstart.enable(mode='sometimes')\nexcept ValueError as e:\n    print(e)\n"
        "print(os.environ.get('WARMSTART'))"
    )
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
        "rediss://... (TLS) or redis+cluster://host:port[,host:port...]"
    ]


# -- the PGO job id: one per entry script or module --------------------------------------------

_PRINT_JOB_ID = "import os, torch\nprint('JOB', torch.compiler.config.job_id, os.environ['TORCH_COMPILE_JOB_ID'])\n"


def _job_id(tmp_path, *args: str, cwd=None, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCH_COMPILE"))}
    base.update(WARMSTART="1", WARMSTART_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path), **env)
    proc = subprocess.run(
        [sys.executable, *args], env=base, cwd=cwd or tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("JOB ")]
    _, in_torch, in_env = line.split()
    assert in_torch == in_env
    return in_torch


def test_python_dash_m_modules_get_their_own_pgo_job_id(tmp_path):
    """``python -m`` used to hash the ``-m`` that ``sys.argv`` holds at start-up: every module shared one id."""
    for pkg in ("jobs_a", "jobs_b"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "train.py").write_text(_PRINT_JOB_ID)
    a = _job_id(tmp_path, "-m", "jobs_a.train")
    b = _job_id(tmp_path, "-m", "jobs_b.train")
    assert a != b and a.startswith("warmstart:")
    assert _job_id(tmp_path, "-X", "utf8", "-Bu", "-m", "jobs_a.train", "--lr", "3") == a  # same module, same id


def test_script_pgo_job_id_is_its_file_name_as_before(tmp_path):
    import hashlib

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "train.py").write_text(_PRINT_JOB_ID)
    (tmp_path / "two" / "train.py").write_text(_PRINT_JOB_ID)
    (tmp_path / "eval.py").write_text(_PRINT_JOB_ID)
    first = _job_id(tmp_path, str(tmp_path / "one" / "train.py"))
    assert first == "warmstart:" + hashlib.sha256(b"train.py").hexdigest()[:16]
    assert _job_id(tmp_path, "one/train.py", "--epochs", "2") == first
    assert _job_id(tmp_path, "-W", "ignore", str(tmp_path / "two" / "train.py")) == first
    assert _job_id(tmp_path, str(tmp_path / "eval.py")) != first


def test_explicit_job_ids_win(tmp_path):
    (tmp_path / "train.py").write_text(_PRINT_JOB_ID)
    assert _job_id(tmp_path, "train.py", WARMSTART_JOB_ID="run-7") == "warmstart:run-7"
    assert _job_id(tmp_path, "train.py", TORCH_COMPILE_JOB_ID="mine") == "mine"


def test_entry_point_parsing_of_interpreter_command_lines():
    from warmstart.compile_cache.entry_point import _entry_from_command_line as entry

    assert entry(["-m", "pkg.train", "--lr", "3"]) == "pkg.train"
    assert (
        entry(["-Im", "pkg.train"])
        == entry(["-mpkg.train"])
        == entry(["-X", "dev", "-W", "error", "-m", "pkg.train"])
        == entry(["-Xdev", "--check-hash-based-pycs", "never", "-B", "-m", "pkg.train"])
        == "pkg.train"
    )
    assert entry(["/a/b/train.py", "-m", "x"]) == entry(["-u", "train.py"]) == "train.py"
    assert entry(["-c", "print(1)", "x"]) == "-c print(1)" != entry(["-c", "print(2)"])
    assert entry(["-"]) == "-" and entry([]) is None and entry(["-i"]) is None
