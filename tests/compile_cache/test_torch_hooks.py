"""warmstart's changes to what torch does around C++ kernels and frames, with real torch and g++: the
name of a precompiled header (from a stored digest of its preprocessed source, never a different
name than torch's own), when a precompiled header is built or fetched, each kernel's build started
as it is generated, the GIL's switch interval while Inductor generates code, and the guard-latency
figure Dynamo times for every new frame."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _machine
import pytest


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


def _tiny_header(machine: Path):
    """A small header on ``machine``, where torch keeps its precompiled headers, with the builder that
    precompiles it and its store key."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import invalid_vec_isa

    from warmstart.compile_cache import torch_hooks

    header = machine / "precompiled_headers" / "cwarmstarttest.h"
    (header.parent / "locks").mkdir(parents=True)
    header.write_text("#pragma once\ninline int answer() { return 42; }\n")
    options = CppTorchDeviceOptions(vec_isa=invalid_vec_isa, device_type="cpu", precompiling=True)
    builder = CppBuilder(name=str(header), sources=str(header), BuildOption=options)
    return header, builder, torch_hooks.cpp_object_key(builder.get_command_line(), builder.get_target_file_path())


def test_a_header_is_prefetched_as_code_generation_starts_and_a_build_waits_for_that_fetch(tmp_path, redis_node):
    """Once Inductor generates a kernel (the graph missed the cache, so some kernel may be new), the
    deferred header is fetched in a thread of its own; a kernel build that needs it meanwhile waits
    for that fetch (made slow here) instead of fetching or building it again. The fetched header is
    the stored one, written in place and not copied into the local tier."""
    import threading

    from torch._inductor.cpp_builder import CppBuilder

    from warmstart.compile_cache import LocalTier, RemoteTier, TieredStore, set_store, torch_hooks

    build = getattr(CppBuilder.build, "__wrapped__", CppBuilder.build)
    writer = TieredStore(
        LocalTier(tmp_path / "a" / "ws", 1 << 30), RemoteTier(redis_node.url, secret=b"s", namespace="pch")
    )
    set_store(writer)
    header_a, builder_a, key = _tiny_header(tmp_path / "a")
    torch_hooks._deferred_pch[str(header_a)] = (builder_a, key)
    torch_hooks._materialize_pch(f"g++ -include {header_a} kernel.cpp", build)  # built, and stored
    assert writer.flush(timeout=30)
    writer.close()

    remote = RemoteTier(redis_node.url, secret=b"s", namespace="pch")
    reader = TieredStore(LocalTier(tmp_path / "b" / "ws", 1 << 30), remote)
    set_store(reader)
    fetching, release = threading.Event(), threading.Event()
    real_get = remote.get

    def slow_get(kind, k):  # a slow shared tier
        fetching.set()
        release.wait(60)
        return real_get(kind, k)

    remote.get = slow_get
    header_b, builder_b, key_b = _tiny_header(tmp_path / "b")
    assert key_b == key  # the same header on another machine: the same key
    torch_hooks._deferred_pch[str(header_b)] = (builder_b, key)
    builds = []
    torch_hooks._prefetch_pch()
    torch_hooks._prefetch_pch()  # once per header
    prefetchers = [t for t in threading.enumerate() if t.name == "warmstart-pch-prefetch"]
    assert len(prefetchers) == 1 and fetching.wait(30)
    needing = threading.Thread(
        target=torch_hooks._materialize_pch,
        args=(f"g++ -include {header_b} kernel.cpp", lambda b: builds.append(b) or build(b)),
    )
    needing.start()
    needing.join(1.0)
    assert needing.is_alive()  # waits for the fetch in flight
    release.set()
    needing.join(60)
    prefetchers[0].join(60)
    assert not needing.is_alive() and builds == []
    assert Path(f"{header_b}.gch").read_bytes() == Path(f"{header_a}.gch").read_bytes()
    assert str(header_b) not in torch_hooks._deferred_pch
    assert reader.flush(timeout=30) and not reader.local.get("cpp_object", key)


def test_a_prefetch_that_finds_no_header_or_a_failing_store_leaves_it_to_the_build(tmp_path, monkeypatch, caplog):
    """Fault injection: the store has no such header, then a store raises at every lookup. The
    prefetch writes nothing (one warning for the store that raises) and the header stays deferred:
    the first build that needs it builds it, once."""
    import logging

    from torch._inductor.cpp_builder import CppBuilder

    from warmstart.compile_cache import LocalTier, TieredStore, get_store, set_store, storage, torch_hooks

    class BrokenStore:
        def get(self, kind, key, **kwargs):
            raise RuntimeError("store down")

        def put(self, kind, key, data, cost_s=0.0):
            raise RuntimeError("store down")

        def close(self):
            pass

    monkeypatch.setattr(storage, "_hook_failed", False)
    build = getattr(CppBuilder.build, "__wrapped__", CppBuilder.build)
    header, builder, key = _tiny_header(tmp_path)
    gch = Path(f"{header}.gch")
    empty = TieredStore(LocalTier(tmp_path / "empty", 1 << 30), None)
    for store in (empty, BrokenStore()):
        set_store(store)
        torch_hooks._deferred_pch[str(header)] = (builder, key)
        torch_hooks._prefetched_pch.discard(str(header))
        torch_hooks._looked_up_pch.discard(str(header))
        with caplog.at_level(logging.WARNING, logger=storage.log.name):
            torch_hooks._prefetch_one(str(header))
        assert not gch.exists() and str(header) in torch_hooks._deferred_pch
    assert sum("C++ object cache" in r.getMessage() for r in caplog.records) == 1, caplog.records
    empty.close()
    builds = []
    command = f"g++ -include {header} kernel.cpp"
    set_store(TieredStore(LocalTier(tmp_path / "ws", 1 << 30), None))
    torch_hooks._materialize_pch(command, lambda b: builds.append(b) or build(b))
    torch_hooks._materialize_pch(command, lambda b: builds.append(b) or build(b))
    assert len(builds) == 1 and gch.stat().st_size > 0
    assert str(header) not in torch_hooks._deferred_pch
    stats = get_store().stats.get("local", "cpp_object")
    assert (stats.hits, stats.misses) == (0, 0)  # the prefetch looked it up: the build does not again


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


EARLY_BUILDS = """
    import json, os, sys, threading
    import torch
    from torch._inductor import async_compile, codecache, cpp_builder
    from warmstart.compile_cache import get_store

    if os.environ.get("STORE_RAISES"):  # fault injection: every C++ object lookup raises
        store = get_store()
        real_get = store.get

        def get(kind, key, **kwargs):
            if kind == "cpp_object":
                raise RuntimeError("store down")
            return real_get(kind, key, **kwargs)

        store.get = get

    from warmstart.compile_cache import torch_hooks

    intervals = []  # the GIL's switch interval as each kernel is generated
    recorded_start = torch_hooks._start_cpp_build

    def start(kernel_body):
        intervals.append(sys.getswitchinterval())
        return recorded_start(kernel_body)

    torch_hooks._start_cpp_build = start
    if os.environ.get("EARLY_START_RAISES"):  # fault injection: warmstart's part of the early start raises

        def broken(kernel_body):
            raise RuntimeError("early start broken")

        torch_hooks._start_cpp_build = broken

    builds = []  # each kernel's build: [on the main thread, how it ended]
    hooked_build = cpp_builder.CppBuilder.build

    def for_a_kernel(builder):  # not a header, nor one of the vector-ISA probe's test libraries
        if builder.get_target_file_path().endswith(".gch"):
            return False
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_name != "_worker_compile_cpp":
            frame = frame.f_back
        return frame is not None

    def build(self):
        if not for_a_kernel(self):
            return hooked_build(self)
        main = threading.current_thread() is threading.main_thread()
        try:
            hooked_build(self)
        except BaseException as exc:
            builds.append([main, type(exc).__name__])
            raise
        builds.append([main, "ok"])

    cpp_builder.CppBuilder.build = build
    started = []  # as the compiled module loads: was each kernel started when it was generated?
    loading = async_compile.AsyncCompile.cpp_pybinding

    def cpp_pybinding(self, argtypes, source):
        before = len(codecache.CppPythonBindingsCodeCache.cache)
        kernel = loading(self, argtypes, source)
        started.append(len(codecache.CppPythonBindingsCodeCache.cache) == before)
        return kernel

    async_compile.AsyncCompile.cpp_pybinding = cpp_pybinding
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))
    x = torch.randn(8, 16)
    loss = torch.compile(model)(x).square().mean()
    loss.backward()
    print("RESULT " + json.dumps({
        "started": started, "builds": builds, "loss": loss.item(),
        "intervals": intervals, "interval_after": sys.getswitchinterval(),
        "grad": model[0].weight.grad.flatten().tolist(),
    }))
"""


def early_env(machine: Path, store: Path, **extra: str) -> dict[str, str]:
    # Two compile threads (the tests' machines use one): a kernel is started early only when
    # Inductor has threads to build it in while it goes on generating code.
    return {**machine_env(machine, store), "TORCHINDUCTOR_COMPILE_THREADS": "2", **extra}


# A compile that generates code again on a machine whose store holds its kernels: the graph caches
# of Inductor and AOTAutograd off, local and shared.
GENERATE_AGAIN = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "0",
}


def test_a_kernel_is_built_or_fetched_as_soon_as_it_is_generated(tmp_path):
    """Inductor starts its C++ kernels' builds only once it has generated the whole graph's code;
    warmstart starts each one in Inductor's compile threads as soon as it is generated. The module,
    when it loads, finds every kernel it asks for already started, under its own key, and the results
    are torch's: on a new machine (g++ builds them) and on one whose store holds them (fetched)."""
    store = tmp_path / "store"
    cold = run_result(EARLY_BUILDS, early_env(tmp_path / "a", store))
    assert cold["started"] and all(cold["started"]), cold
    assert cold["builds"] == [[False, "ok"]] * len(cold["started"]), cold["builds"]  # in the compile threads
    # While Inductor generates code, its compile threads get the GIL within 1 ms; as it was after.
    assert cold["intervals"] and all(i <= 0.001 for i in cold["intervals"]), cold["intervals"]
    assert cold["interval_after"] == 0.005

    again = run_result(EARLY_BUILDS, early_env(tmp_path / "b", store, **GENERATE_AGAIN))
    assert again["started"] == cold["started"], again
    assert again["builds"] == cold["builds"], again["builds"]
    assert again["loss"] == cold["loss"] and again["grad"] == cold["grad"]
    plain = run_result(EARLY_BUILDS, {**early_env(tmp_path / "c", tmp_path / "other"), "WARMSTART": "0"})
    assert plain["started"] == [False] * len(cold["started"]), plain  # torch's own: started as the module loads
    assert plain["loss"] == cold["loss"] and plain["grad"] == cold["grad"]


def test_a_store_that_raises_while_a_kernel_starts_early_leaves_the_build_to_g_plus_plus(tmp_path):
    """Fault injection: every C++ object lookup raises. The kernels started early are built by g++ in
    Inductor's compile threads, with one warning for the store, and the compile gives torch's results."""
    result = run_result(
        EARLY_BUILDS, early_env(tmp_path / "a", tmp_path / "store", STORE_RAISES="1"), stderr_lines=True
    )
    assert result["started"] and all(result["started"]), result
    assert result["builds"] == [[False, "ok"]] * len(result["started"]), result["builds"]
    assert sum("C++ object cache" in line for line in result["stderr"]) == 1, result["stderr"]
    plain = run_result(EARLY_BUILDS, {**early_env(tmp_path / "b", tmp_path / "other"), "WARMSTART": "0"})
    assert result["loss"] == plain["loss"] and result["grad"] == plain["grad"]


def test_an_early_start_that_raises_leaves_the_kernel_to_torchs_own_start(tmp_path):
    """Fault injection: warmstart's part of the early start raises. One warning; the kernels are
    started as torch starts them, when the module loads, and the compile gives torch's results."""
    result = run_result(
        EARLY_BUILDS, early_env(tmp_path / "a", tmp_path / "store", EARLY_START_RAISES="1"), stderr_lines=True
    )
    assert result["started"] == [False] * len(result["started"]) and result["started"], result
    assert result["builds"] == [[False, "ok"]] * len(result["started"]), result["builds"]
    assert sum("early C++ kernel build" in line for line in result["stderr"]) == 1, result["stderr"]
    plain = run_result(EARLY_BUILDS, {**early_env(tmp_path / "b", tmp_path / "other"), "WARMSTART": "0"})
    assert result["loss"] == plain["loss"] and result["grad"] == plain["grad"]


def test_with_one_compile_thread_nothing_is_started_early_and_the_gils_interval_stays(tmp_path):
    """One compile thread (Inductor builds each kernel in line as the module loads): no kernel is
    started as it is generated and the GIL's switch interval is left as it is."""
    result = run_result(EARLY_BUILDS, machine_env(tmp_path / "a", tmp_path / "store"))
    assert result["started"] == [False] * len(result["started"]) and result["started"], result
    assert result["intervals"] and set(result["intervals"]) == {0.005}, result["intervals"]
    assert result["builds"] == [[True, "ok"]] * len(result["started"]), result["builds"]  # in line


def test_the_gils_interval_comes_back_when_code_generation_raises(monkeypatch):
    """Fault injection: code generation raises (also inside a nested one): the interval is back to
    what it was once the outermost one ends."""
    from torch._inductor import config

    from warmstart.compile_cache import torch_hooks

    monkeypatch.setattr(config, "compile_threads", 2)
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="codegen failed"), torch_hooks._short_switch_interval():
        with torch_hooks._short_switch_interval():
            assert sys.getswitchinterval() == 0.001
        assert sys.getswitchinterval() == 0.001  # the outer one is still generating
        raise RuntimeError("codegen failed")
    assert sys.getswitchinterval() == before
