"""The torch a user actually has: on a torch release warmstart was not checked against, one warning
per process and a job whose results are plain torch's; torch's autotune caches switched on only where
torch can use them (here: Triton installed, no GPU); a switch warmstart turned on that makes torch
itself raise is turned off again, one warning, and the job goes on.

Real processes and real ``torch.compile`` throughout. The unchecked release is made by the job itself
naming the checked set before torch is imported (``_versions_job.py --checked``); the running torch
is whichever this venv has (the pinned one, or the newest in ``make test-newest``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from _machine import machine_env
from _redis import in_ci

from warmstart import torch_internals, torch_support

JOB = Path(__file__).with_name("_versions_job.py")
#: The Triton ``make setup`` installs beside the venv, outside its packages (see test_triton_manager).
TRITON_REFERENCE = Path(sys.prefix) / "triton-reference"


def _job(machine: Path, *options: str, triton: bool = False, **extra: str) -> dict:
    env = machine_env(machine, **extra)
    if triton:
        env = _with_triton(env)
    proc = subprocess.run([sys.executable, str(JOB), *options], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["warnings"] = [line for line in proc.stderr.splitlines() if line.startswith("warmstart:")]
    return result


def _with_triton(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job that finds a Triton: the one installed here, else the reference Triton."""
    if importlib.util.find_spec("triton") is not None:
        return env
    if not TRITON_REFERENCE.is_dir():
        reason = f"no Triton installed and no {TRITON_REFERENCE} (make setup installs it)"
        if in_ci():
            pytest.fail(f"{reason}; CI is set, where `make test` installs it", pytrace=False)
        pytest.skip(reason)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRITON_REFERENCE), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    """The same job with plain torch (warmstart off)."""
    return _job(tmp_path_factory.mktemp("plain"), WARMSTART="0")


# -- versions, as strings ------------------------------------------------------------------------


def test_a_version_is_checked_by_its_public_part():
    assert torch_support.is_checked("2.13.0+cpu", ("2.13.0",))
    assert torch_support.is_checked("2.15.0+cu132", ("2.13.0", "2.15.0"))
    assert not torch_support.is_checked("2.15.0+cu132", ("2.13.0",))
    assert not torch_support.is_checked("2.13.1", ("2.13.0",))
    assert not torch_support.is_checked("2.16.0.dev20270101+cpu", ("2.13.0", "2.15.0"))


def test_the_running_torch_is_a_checked_one():
    """Every torch the suite runs on (the pinned one, the newest) is in the checked set: a release
    added to the suite's range is added there, and one dropped from it is dropped there."""
    import torch

    assert torch_support.is_checked(torch.__version__), (torch.__version__, torch_support.TORCH_VERSIONS_CHECKED)


def test_compiled_frames_are_checked_on_a_subset_of_the_checked_versions():
    assert set(torch_support.FRAMES_VERSIONS_CHECKED) <= set(torch_support.TORCH_VERSIONS_CHECKED)
    assert torch_support.frames_checked("2.13.0+cpu")
    assert not torch_support.frames_checked("2.15.0+cu132")  # CompilePackage.bypass_current_entry is gone


def test_the_warning_names_the_version_and_what_is_off():
    line = torch_support.unchecked_warning("2.99.0+cu140")
    assert "torch 2.99.0+cu140" in line and "compiled frames (WARMSTART_DYNAMO) are off" in line
    assert ", ".join(torch_support.TORCH_VERSIONS_CHECKED) in line


# -- the internals each hook relies on -------------------------------------------------------------


def test_every_internal_a_hook_relies_on_is_there_in_this_torch():
    import importlib

    for name in torch_internals.PATCHED:
        torch_internals.check_internals(name, importlib.import_module(name))


def test_a_moved_internal_is_found_before_its_hook_goes_in():
    class VecISA:
        def _probe_load(self, path: str) -> bool:  # renamed parameter
            return True

    renamed = types.ModuleType("torch._inductor.cpu_vec_isa")
    renamed.VecISA = VecISA  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="expected \\(self, output_path"):
        torch_internals.check_internals("torch._inductor.cpu_vec_isa", renamed)
    with pytest.raises(AttributeError, match="GraphLowering.codegen is gone"):
        torch_internals.check_internals("torch._inductor.graph", types.ModuleType("torch._inductor.graph"))


# -- jobs --------------------------------------------------------------------------------------


def test_an_unchecked_torch_gives_one_warning_and_plain_torch_results(tmp_path, plain):
    """Two frames compiled in one process on a torch the job takes as unchecked, compiled frames
    asked for: one warning (the version, what is off), frames off, the losses of plain torch."""
    result = _job(tmp_path / "m", "--checked", "0.0.1", WARMSTART_DYNAMO="1")
    assert result["losses"] == plain["losses"]
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert f"torch {result['torch']} is not among" in warning and "(0.0.1)" in warning, warning
    assert "compiled frames (WARMSTART_DYNAMO) are off" in warning
    assert result["frames"] is False
    assert result["fx_graph_remote_cache"] is True  # the caches behind a stable hook stay on


def test_a_checked_torch_runs_compiled_frames_only_where_they_were_checked(tmp_path, plain):
    """The torch of this venv, compiled frames asked for: on where they were checked (2.13), else off
    with one warning that says so (2.15, which removed a call of Dynamo's they make)."""
    result = _job(tmp_path / "m", WARMSTART_DYNAMO="1")
    frames = torch_support.frames_checked(result["torch"])
    assert result["frames"] is frames
    assert result["warnings"] == ([] if frames else [torch_support.frames_off_warning(result["torch"])])
    assert result["losses"] == plain["losses"]


def test_compiled_frames_not_checked_on_this_torch_are_off_with_one_warning(tmp_path, plain):
    result = _job(tmp_path / "m", "--frames-checked", "0.0.1", WARMSTART_DYNAMO="1")
    assert result["frames"] is False
    assert len(result["warnings"]) == 1, result["warnings"]
    assert f"compiled frames (WARMSTART_DYNAMO) are off: torch {result['torch']}" in result["warnings"][0]
    assert "(0.0.1)" in result["warnings"][0]
    assert result["losses"] == plain["losses"]


def test_with_triton_and_no_gpu_the_autotune_caches_stay_off(tmp_path, plain):
    """Triton importable but no device for it (this machine): torch cannot hash Triton's backend, so
    warmstart leaves its autotune caches off (switched on, torch asserts in every compile)."""
    result = _job(tmp_path / "m", triton=True)
    assert result["warnings"] == []
    assert result["autotune_remote_cache"] is None and result["bundled_autotune_remote_cache"] is None
    assert result["losses"] == plain["losses"]


def test_a_switch_that_makes_torch_raise_is_turned_off_with_one_warning(tmp_path, plain):
    """warmstart taking the autotune caches as usable where torch cannot use them: torch raises in
    its bundled autotune cache at every graph; the job goes on as plain torch, one warning."""
    result = _job(tmp_path / "m", "--force-autotune", triton=True)
    assert result["losses"] == plain["losses"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "autotune cache, switched on by warmstart" in result["warnings"][0]
    assert result["autotune_remote_cache"] is None and result["bundled_autotune_remote_cache"] is None


def test_the_doctor_says_when_torch_is_unchecked(tmp_path):
    code = (
        "import sys; from warmstart import torch_support; "
        "torch_support.TORCH_VERSIONS_CHECKED = ('0.0.1',); "
        "from warmstart.cli import main; sys.argv = ['warmstart', 'cache', 'doctor', '--json']; main()"
    )
    env = machine_env(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["torch"]["status"] == "warn"
    assert "is not among the versions warmstart was checked against (0.0.1)" in checks["torch"]["detail"]
    proc = subprocess.run(
        [sys.executable, "-m", "warmstart", "cache", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["torch"]["status"] == "ok"
