"""Two of warmstart's changes to what torch does, each in a real process with real torch and g++:
the name of a precompiled header (from a stored digest of its preprocessed source, never a
different name than torch's own), and the guard-latency figure Dynamo times for every new frame."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _machine


def machine_env(machine: Path, store: Path) -> dict[str, str]:
    """A new "machine" whose local warmstart tier is ``store`` (shared by the machines of a test)."""
    return _machine.machine_env(machine, WARMSTART_CACHE_DIR=str(store), WARMSTART_PRELOAD="0")


def run_result(code: str, env: dict[str, str], stderr_lines: bool = False) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    if stderr_lines:
        result["stderr"] = proc.stderr.splitlines()
    return result


NAME_HEADER = """
    import json, os
    from torch._inductor import codecache
    from torch._inductor.cpu_vec_isa import invalid_vec_isa
    from warmstart.compile_cache import get_store

    hooked = codecache._precompile_header
    # the arguments CppPythonBindingsCodeCache passes for a kernel's header on CPU
    command = dict(include_pytorch=True, shared=True, device_type="cpu", extra_flags=(),
                   use_relative_path=False, vec_isa=invalid_vec_isa)
    args = ("torch/csrc/inductor/cpp_prefix.h", "g++ kernel.cpp -O3 -o kernel.so")
    ours = hooked(*args, **command)
    result = {"hooked": hasattr(hooked, "__wrapped__"), "ours": ours, "exists": os.path.exists(ours)}
    result["digest"] = get_store().stats.get("local", "header_digest").to_dict()
    if os.environ.get("ALSO_TORCH"):
        result["torch"] = hooked.__wrapped__(*args, **command)  # torch's own: g++ -E and openssl sha512
    print("RESULT " + json.dumps(result))
"""


def test_a_precompiled_header_gets_torchs_name_and_is_preprocessed_on_one_machine_only(tmp_path):
    """torch names a precompiled header after the SHA-512 of its preprocessed source (5 MB, 1-2 s of
    g++ -E); warmstart stores that digest, so a new machine names the header without preprocessing
    it, and the name is the one torch itself gives it."""
    store = tmp_path / "store"
    first = run_result(NAME_HEADER, {**machine_env(tmp_path / "a", store), "ALSO_TORCH": "1"})
    assert first["hooked"]
    assert first["ours"] == first["torch"], first  # the same header, as torch names it
    assert first["exists"]
    assert first["digest"]["misses"] == 1 and first["digest"]["writes"] == 1, first
    second = run_result(NAME_HEADER, machine_env(tmp_path / "b", store))
    assert second["digest"]["hits"] == 1 and second["digest"]["misses"] == 0, second
    assert second["exists"]
    # the same name on the new machine (its cache directory has another path: compare the file name)
    assert os.path.basename(second["ours"]) == os.path.basename(first["ours"])


def test_a_new_frames_guard_latency_is_timed_without_evicting_the_caches(tmp_path):
    """Dynamo evicts the CPU caches (20-30 ms) before it times each new frame's guards for its
    metrics; with warmstart the figure is one check with warm caches, still recorded."""
    result = run_result(
        """
        import json, torch
        import torch._dynamo.guards as guards
        from torch._C._dynamo.guards import profile_guard_manager as torchs_own
        from torch._dynamo.utils import get_compilation_metrics

        calls = []
        timer = guards.profile_guard_manager

        def counting(root, f_locals, n_iters):
            calls.append(n_iters)
            return timer(root, f_locals, n_iters)

        guards.profile_guard_manager = counting
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        out = torch.compile(model, backend="eager")(torch.ones(2, 4))
        latency = [m.guard_latency_us for m in get_compilation_metrics()]
        print("RESULT " + json.dumps({
            "replaced": timer is not torchs_own and getattr(timer, "__wrapped__", None) is torchs_own,
            "calls": calls, "latency": latency, "out": out.shape[0],
        }))
        """,
        machine_env(tmp_path, tmp_path / "store"),
    )
    assert result["replaced"], result
    assert result["calls"] == [1], result  # one new frame, timed once
    assert len(result["latency"]) == 1 and result["latency"][0] is not None, result


def test_a_deferred_precompiled_header_is_built_under_torchs_lock(tmp_path):
    """warmstart builds a precompiled header only when a build needs it, later than torch would, and
    g++ writes it straight to its place: it must do so under torch's lock for that header, or another
    process of the machine compiles against a half-written one (g++ then used 22 GB of memory)."""
    import threading

    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import invalid_vec_isa
    from torch.utils._filelock import FileLock

    from warmstart.compile_cache import torch_hooks

    header = tmp_path / "precompiled_headers" / "cwarmstarttest.h"
    header.parent.mkdir()
    header.write_text("#pragma once\ninline int answer() { return 42; }\n")
    options = CppTorchDeviceOptions(vec_isa=invalid_vec_isa, device_type="cpu", precompiling=True)
    builder = CppBuilder(name=str(header), sources=str(header), BuildOption=options)
    build = getattr(CppBuilder.build, "__wrapped__", CppBuilder.build)
    torch_hooks._deferred_pch[str(header)] = (builder, "a key no store holds")
    lock_path = Path(torch_hooks.pch_lock_path(str(header)))
    assert lock_path == header.parent / "locks" / "cwarmstarttest.lock"  # where torch's _precompile_header locks
    lock_path.parent.mkdir()
    done = threading.Event()

    def materialize():
        torch_hooks._materialize_pch(f"g++ -include {header} kernel.cpp", build)
        done.set()

    holder = FileLock(str(lock_path))  # another process building the header holds this
    holder.acquire()
    worker = threading.Thread(target=materialize)
    worker.start()
    try:
        assert not done.wait(3.0)  # it waits for the holder...
        assert not Path(f"{header}.gch").exists()
    finally:
        holder.release()
    worker.join(timeout=120)
    assert done.is_set() and Path(f"{header}.gch").stat().st_size > 0  # ...then builds it


def test_a_store_that_raises_while_naming_a_header_costs_one_warning_and_torchs_own_name(tmp_path):
    """Fault injection: the store raises at the digest's lookup. The header is named as torch names
    it (torch preprocesses it itself), with one warning; the compile is never failed."""
    result = run_result(
        """
        import json
        from torch._inductor import codecache
        from torch._inductor.cpu_vec_isa import invalid_vec_isa
        from warmstart.compile_cache import set_store

        class BrokenStore:
            def get(self, kind, key, **kwargs):
                raise RuntimeError("store down")

            def put(self, kind, key, data, cost_s=0.0):
                raise RuntimeError("store down")

        set_store(BrokenStore())
        command = dict(include_pytorch=True, shared=True, device_type="cpu", extra_flags=(),
                       use_relative_path=False, vec_isa=invalid_vec_isa)
        args = ("torch/csrc/inductor/cpp_prefix.h", "g++ kernel.cpp -O3 -o kernel.so")
        hooked = codecache._precompile_header
        ours = hooked(*args, **command)
        print("RESULT " + json.dumps({"ours": ours, "torch": hooked.__wrapped__(*args, **command)}))
        """,
        machine_env(tmp_path, tmp_path / "store"),
        stderr_lines=True,
    )
    assert result["ours"] == result["torch"], result
    assert sum("precompiled header name" in line for line in result["stderr"]) == 1, result["stderr"]
