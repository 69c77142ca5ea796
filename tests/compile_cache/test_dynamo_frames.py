"""Dynamo's output shared through the signed store, with real ``torch.compile`` jobs on brand-new
"machines": a producer compiles four models and signs its entries into a real redis-server; every
other machine only verifies (public key), so what one variant compiles never reaches another.

A warm machine must skip Dynamo for frames that qualify and give the producer's results; any change
a frame depends on (a global, a flag, a builtin, an input's shape or dtype, a module attribute or
submodule, a torch config, a line of code) must make it trace again, never reuse a stale frame.
Every job also checks its outputs and gradients against eager PyTorch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _machine import machine_env

HERE = Path(__file__).resolve().parent
JOB = HERE / "_frames_job.py"
#: Hang guard for a few small compiles on 2 cores: not a speed check.
HANG_GUARD_S = 600
#: What the producer compiles: a whole model, one with a graph break, one compiled layer by layer, one
#: calling a function Dynamo compiles on its own but cannot name.
MODELS = ("net", "broken", "stack", "callee")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_GUARD_S)]


def _model_dir(root: Path, name: str, edit: tuple[str, str] | None = None) -> Path:
    directory = root / name
    directory.mkdir()
    source = (HERE / "_frames_model.py").read_text()
    if edit is not None:
        assert edit[0] in source
        source = source.replace(*edit)  # one line for another: every other line keeps its number
    (directory / "frames_model.py").write_text(source)
    return directory


def _job(
    machine: Path, model_dir: Path, model: str, variant: str = "base", script: Path = JOB, **env_extra: str
) -> dict:
    env = machine_env(machine, **{"WARMSTART_DYNAMO": "1", **env_extra})  # a test may set it otherwise
    # Each machine works in a directory of its own (torch's configs hold paths such as the working
    # directory's: they must not be part of the key).
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), "--model", model, "--variant", variant],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=machine,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    result["log"] = [line for line in proc.stderr.splitlines() if "warmstart" in line]
    return result


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """A redis-server holding the producer's entries for the models; reader settings."""
    from _redis import RedisNode

    from warmstart.compile_cache.signing import generate_key_pair

    root = tmp_path_factory.mktemp("frames")
    generate_key_pair(root / "signing.key", root / "verify.pub")
    node = RedisNode(root / "redis").start()
    models = _model_dir(root, "models")
    producer = {"WARMSTART_CACHE_URL": node.url, "WARMSTART_KEY_FILE": str(root / "signing.key")}
    with ThreadPoolExecutor(max_workers=2) as pool:  # one machine, two jobs at a time: the cold compiles dominate
        cold = dict(
            zip(MODELS, pool.map(lambda model: _job(root / "producer", models, model, **producer), MODELS), strict=True)
        )
    yield {
        "root": root,
        "models": models,
        "cold": cold,
        "reader": {"WARMSTART_CACHE_URL": node.url, "WARMSTART_KEY_FILE": str(root / "verify.pub")},
    }
    node.stop()
    shutil.rmtree(root, ignore_errors=True)


def _machines(shared_cache, runs: dict[str, tuple]) -> dict[str, dict]:
    """Run each ``name: (model_dir, model, variant)`` on its own new machine, two at a time."""
    root = shared_cache["root"]

    def run(item):
        name, (model_dir, model, variant) = item
        return name, _job(root / f"machine-{name}", model_dir, model, variant, **shared_cache["reader"])

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, runs.items()))


def test_the_producer_compiles_and_stores_frames(shared_cache):
    for model, result in shared_cache["cold"].items():
        assert result["same"], model
        assert result["traced"] >= 1 and result["frames_writes"] >= 1, (model, result)


def test_a_called_function_without_a_name_is_traced_not_an_error(shared_cache):
    """torch's package raises in the middle of the compile for a frame it cannot name: the producer
    compiled it (above), and a new machine traces that frame again with the producer's results."""
    result = _machines(shared_cache, {"callee": (shared_cache["models"], "callee", "base")})["callee"]
    assert result["same"] and result["traced"] >= 1, result
    assert result["loss"] == shared_cache["cold"]["callee"]["loss"]
    assert not [line for line in result["log"] if "not used" in line], result["log"]


def test_a_new_machine_skips_dynamo_and_gives_the_same_results(shared_cache):
    models = shared_cache["models"]
    warm = _machines(shared_cache, {model: (models, model, "base") for model in ("net", "stack")})
    for model, result in warm.items():
        assert result["same"], model
        assert result["frames_hits"] >= 1 and result["traced"] == 0, (model, result)
        assert result["loss"] == shared_cache["cold"][model]["loss"], model  # the producer's kernels, bit for bit


def test_a_model_whose_frames_only_partly_qualify(shared_cache):
    """Before its graph break the frame is packaged; after it, a closure's guard cannot be kept, so
    that frame is traced again, and only that one."""
    result = _machines(shared_cache, {"broken": (shared_cache["models"], "broken", "base")})["broken"]
    assert result["same"]
    assert result["frames_hits"] >= 1
    assert result["traced"] == 1
    assert result["loss"] == shared_cache["cold"]["broken"]["loss"]


@pytest.mark.parametrize(
    "variants", [("global", "flag", "builtin", "shape", "dtype", "attribute", "submodule", "torch-config")]
)
def test_no_stale_frame_when_what_it_reads_changed(shared_cache, variants):
    results = _machines(shared_cache, {v: (shared_cache["models"], "net", v) for v in variants})
    for variant, result in results.items():
        assert result["same"], (variant, result)  # a stale frame would compute the old model
        assert result["traced"] >= 1, (variant, result)


def test_no_stale_frame_when_a_line_of_code_changed(shared_cache):
    root = shared_cache["root"]
    forward = _model_dir(root, "forward-edited", ("* self.scale\n", "* self.scale * 2.0\n"))
    helper = _model_dir(root, "helper-edited", ("return x * SCALE + 1.0", "return x * SCALE - 1.0"))
    held = _model_dir(root, "held-edited", ("return x * 0.5", "return x * 0.25"))
    results = _machines(
        shared_cache,
        {"forward": (forward, "net", "base"), "helper": (helper, "net", "base"), "held": (held, "net", "base")},
    )
    for name, result in results.items():
        assert result["same"] and result["traced"] >= 1, (name, result)
    # The edited forward has another key. The entry is found for an edited global function and for
    # an edited function the module holds (self.post), and refused in one log line naming it.
    assert results["forward"]["frames_hits"] == 0
    for name, function in (("helper", "helper"), ("held", "halve")):
        assert results[name]["frames_hits"] == 1, results[name]
        refused = [line for line in results[name]["log"] if "compiled frames of" in line]
        assert len(refused) == 1 and function in refused[0], results[name]["log"]


@pytest.mark.parametrize("setting", ["0", ""])
def test_compiled_frames_are_off_unless_warmstart_dynamo_is_1(shared_cache, setting):
    root = shared_cache["root"]
    result = _job(
        root / f"machine-off{setting}",
        shared_cache["models"],
        "net",
        WARMSTART_DYNAMO=setting,
        **shared_cache["reader"],
    )
    assert result["same"]
    assert result["frames_hits"] == 0 and result["frames_misses"] == 0 and result["traced"] == 1


_BROKEN_GUARDS_HOOK = """
import runpy, sys
from warmstart.compile_cache import dynamo_frames

def hook_guards(guards):
    raise AttributeError("torch moved what warmstart hooks in its guards")

dynamo_frames.hook_guards = hook_guards  # before torch._dynamo is imported, so the patch raises
sys.argv[0] = {job!r}
runpy.run_path({job!r}, run_name="__main__")
"""


def test_stored_frames_are_not_run_where_one_of_their_checks_could_not_be_hooked(shared_cache, tmp_path):
    """A torch whose guards warmstart cannot hook (as a new torch version might be): the frames in
    the store are not installed, the model is traced, and the results are eager's."""
    wrapper = tmp_path / "broken_guards_job.py"
    wrapper.write_text(_BROKEN_GUARDS_HOOK.format(job=str(JOB)))
    root = shared_cache["root"]
    result = _job(root / "machine-broken-hook", shared_cache["models"], "net", script=wrapper, **shared_cache["reader"])
    assert result["same"]
    assert result["frames_hits"] == 0 and result["traced"] == 1, result
    assert any("could not hook torch._dynamo.guards" in line for line in result["log"]), result["log"]
    off = [line for line in result["log"] if "compiled frames are off" in line]
    assert len(off) == 1 and "torch._dynamo.guards" in off[0], result["log"]


def test_a_flipped_byte_is_rejected_and_the_frames_traced(shared_cache):
    import redis

    client = redis.Redis.from_url(shared_cache["reader"]["WARMSTART_CACHE_URL"])
    originals = {key: client.get(key) for key in client.scan_iter("ws:*:p:dynamo_frames:*")}
    assert originals
    try:
        for key, value in originals.items():
            broken = bytearray(value)
            broken[-3] ^= 0x20
            client.set(key, bytes(broken))
        result = _job(shared_cache["root"] / "machine-flipped", shared_cache["models"], "net", **shared_cache["reader"])
    finally:
        for key, value in originals.items():
            client.set(key, value)
    assert result["same"] and result["traced"] == 1
    assert result["frames_hits"] == 0 and result["frames_rejected"] >= 1
    assert result["loss"] == shared_cache["cold"]["net"]["loss"]


def test_an_entry_torch_cannot_load_costs_one_warning_and_a_trace(shared_cache, tmp_path):
    """A signed entry whose contents cannot be installed (here: not a package at all) is a trace."""
    import pickle

    import redis

    from warmstart.compile_cache import open_store
    from warmstart.config import Settings

    url = shared_cache["reader"]["WARMSTART_CACHE_URL"]
    writer = open_store(
        Settings.from_env(
            {
                "WARMSTART": "1",
                "WARMSTART_CACHE_URL": url,
                "WARMSTART_CACHE_DIR": str(tmp_path / "writer"),
                "WARMSTART_KEY_FILE": str(shared_cache["root"] / "signing.key"),
            }
        ),
        persist_stats=False,
    )
    client = redis.Redis.from_url(url)
    keys = [name.decode().rsplit(":", 1)[1] for name in client.scan_iter("ws:*:p:dynamo_frames:*")]
    originals = {key: writer.get("dynamo_frames", key).value for key in keys}
    assert keys and all(originals.values())
    try:
        for key in keys:
            writer.put("dynamo_frames", key, pickle.dumps({"format": 1, "entry": None, "identities": {}}), sync=True)
        result = _job(shared_cache["root"] / "machine-damaged", shared_cache["models"], "net", **shared_cache["reader"])
    finally:
        for key, value in originals.items():
            writer.put("dynamo_frames", key, value, sync=True)
        writer.close()
    assert result["same"] and result["traced"] == 1 and result["frames_hits"] == 1
    refused = [line for line in result["log"] if "compiled frames of" in line]
    assert len(refused) == 1 and "Net.forward" in refused[0], result["log"]


def test_installing_waits_for_a_frame_compile_in_another_thread(shared_cache):
    """The first call of a compiled layer installs the stored frames. In a job that runs its model in
    one thread while another traces (a compile warm-up), installing must wait for Dynamo's compile lock: torch's
    guard builders are not thread-safe (two of them at once failed a load midway, and its clean-up then
    removed globals the other thread had just installed)."""
    result = _machines(shared_cache, {"threads": (shared_cache["models"], "stack", "threads")})["threads"]
    assert result["install_waited"], result
    assert result["same"] and result["traced"] == 0 and result["frames_hits"] >= 1, result
    assert not [line for line in result["log"] if "not used" in line], result["log"]


def test_a_resume_function_name_taken_in_this_process_is_not_overwritten(shared_cache):
    """A function traced first in this process named its resume function as the producer named
    Broken's: installing Broken's entry would make the first one resume in Broken's code."""
    result = _machines(shared_cache, {"taken": (shared_cache["models"], "broken", "taken")})["taken"]
    assert result["same"], result
    refused = [line for line in result["log"] if "compiled frames of" in line]
    assert len(refused) == 1 and "__resume_at_" in refused[0] and "another function" in refused[0], result["log"]


def test_compiling_with_another_backend_runs_that_backend(shared_cache):
    """Dynamo runs a code object's installed entries whatever backend is active: once the process
    compiles the model with a backend of its own too, that backend must run, not the stored frames."""
    result = _machines(shared_cache, {"backends": (shared_cache["models"], "net", "backends")})["backends"]
    assert result["frames_hits"] >= 1, result  # the frames were installed first
    assert result["other_backend_calls"] >= 1 and result["same"], result


def test_a_load_that_fails_midway_leaves_no_entry_behind(shared_cache, tmp_path):
    """The regional model's entry with its last guard state damaged: the layers' first entries are
    installed before the load fails, and must be removed again (one warning, then Dynamo traces)."""
    import pickle

    import redis

    from warmstart.compile_cache import open_store
    from warmstart.config import Settings

    url = shared_cache["reader"]["WARMSTART_CACHE_URL"]
    writer = open_store(
        Settings.from_env(
            {
                "WARMSTART": "1",
                "WARMSTART_CACHE_URL": url,
                "WARMSTART_CACHE_DIR": str(tmp_path / "writer"),
                "WARMSTART_KEY_FILE": str(shared_cache["root"] / "signing.key"),
            }
        ),
        persist_stats=False,
    )
    client = redis.Redis.from_url(url)
    originals = {}
    for name in client.scan_iter("ws:*:p:dynamo_frames:*"):
        key = name.decode().rsplit(":", 1)[1]
        stored = pickle.loads(writer.get("dynamo_frames", key).value)
        codes = stored["entry"].dynamo.codes
        if stored["entry"].dynamo.fn_name == "Layer.forward":
            guarded = [g for code in codes for g in code.guarded_codes]
            assert len(guarded) >= 2, codes  # the first layer's input does not require grad, the next ones' does
            originals[key] = pickle.dumps(stored, protocol=pickle.HIGHEST_PROTOCOL)
            guarded[-1].guards_state = b"damaged"
            writer.put("dynamo_frames", key, pickle.dumps(stored, protocol=pickle.HIGHEST_PROTOCOL), sync=True)
    assert originals
    try:
        result = _job(
            shared_cache["root"] / "machine-midway", shared_cache["models"], "stack", **shared_cache["reader"]
        )
    finally:
        for key, value in originals.items():
            writer.put("dynamo_frames", key, value, sync=True)
        writer.close()
    assert result["same"] and result["traced"] >= 1, result
    assert result["loss"] == shared_cache["cold"]["stack"]["loss"]
    refused = [line for line in result["log"] if "compiled frames of" in line]
    assert len(refused) == 1 and "Layer.forward" in refused[0], result["log"]


def test_a_job_read_from_standard_input_compiles_twice(tmp_path):
    """torch's package reads the source of every function a frame inlines, and code read from
    standard input has none: that frame is not packaged, and neither the job that compiles it nor
    the next one on the same machine fails."""
    source = (
        "import torch\n"
        "def helper(x):\n    return x.cos() + 1\n"
        "def f(x):\n    return helper(x) * 2\n"
        "x = torch.arange(4.0)\n"
        "print('RESULT', bool(torch.equal(torch.compile(f)(x), f(x))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.update(
        WARMSTART="1",
        WARMSTART_CACHE_DIR=str(tmp_path / "warmstart"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        WARMSTART_RUN_DIR=str(tmp_path / "runs"),
        TORCHINDUCTOR_COMPILE_THREADS="1",
        # Inductor's vector-ISA build probes (seconds each on a new machine) are not what this checks: passed.
        TORCHINDUCTOR_VEC_ISA_OK="1",
        OMP_NUM_THREADS="1",
    )
    for attempt in range(2):
        proc = subprocess.run(
            [sys.executable, "-"],
            input=source,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            cwd=tmp_path,
        )
        assert proc.returncode == 0 and "RESULT True" in proc.stdout, (attempt, proc.stderr[-3000:])
