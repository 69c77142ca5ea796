"""warmstart switches torch's remote caches on inside the processes it runs in, never through the
environment: a child that does not load warmstart (WARMSTART=0, another environment, a failed start)
must not inherit a switch that sends it to torch's own unauthenticated Redis backend.

Real torch, real redis-servers, real compiles in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "benchmarks" / "compile_job.py"

REMOTE_SWITCHES = (
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE",
)


def machine_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A fresh "machine": empty HOME, TMPDIR and caches; no warmstart or torch switches inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE", "TORCH_DYNAMO", "TRITON"))
    }
    for name in ("home", "tmp"):
        (tmp / name).mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(tmp / "home"),
        TMPDIR=str(tmp / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        WARMSTART_CACHE_DIR=str(tmp / "warmstart"),
        WARMSTART_RUN_DIR=str(tmp / "runs"),
        TORCHINDUCTOR_COMPILE_THREADS="1",
        # Inductor's vector-ISA build probes (seconds each on a new machine) are not what this checks: passed.
        TORCHINDUCTOR_VEC_ISA_OK="1",
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0",
    )
    env.update(extra)
    return env


def run_python(code: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_warmstart_off_child_never_reaches_torchs_redis(redis_node, tmp_path):
    """A WARMSTART=1 job compiles (into warmstart's store), then starts a WARMSTART=0 child that
    compiles on a fresh machine while torch's Redis variables name a plain redis-server: that server
    must stay empty. Before the fix the child inherited TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1 & co."""
    env = machine_env(
        tmp_path / "parent",
        WARMSTART="1",
        TORCHINDUCTOR_REDIS_HOST="127.0.0.1",
        TORCHINDUCTOR_REDIS_PORT=str(redis_node.port),
    )
    child = machine_env(tmp_path / "child")  # its own fresh directories; torch's Redis variables come from env
    proc = run_python(
        f"""
        import json, os, runpy, subprocess, sys
        sys.argv = [{str(JOB)!r}, "--model", "tiny"]
        runpy.run_path({str(JOB)!r}, run_name="__main__")  # this process compiles, with warmstart
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        print("FLAGS " + json.dumps([inductor_config.fx_graph_remote_cache,
                                     functorch_config.enable_remote_autograd_cache,
                                     dynamo_config.automatic_dynamic_remote_pgo]))
        print("ENV " + json.dumps(sorted(k for k in {list(REMOTE_SWITCHES)!r} if k in os.environ)))
        env = dict(os.environ, WARMSTART="0", HOME={child["HOME"]!r}, TMPDIR={child["TMPDIR"]!r},
                   TORCHINDUCTOR_CACHE_DIR={child["TORCHINDUCTOR_CACHE_DIR"]!r})
        child = subprocess.run([sys.executable, {str(JOB)!r}, "--model", "tiny"], env=env,
                               capture_output=True, text=True)
        sys.stderr.write(child.stderr[-3000:])
        assert child.returncode == 0, "child failed"
        print("CHILD " + child.stdout.strip().splitlines()[-1])
    """,
        env,
    )
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}
    parent = json.loads(lines["RESULT"])
    child_result = json.loads(lines["CHILD"][len("RESULT ") :])

    assert redis.Redis.from_url(redis_node.url).dbsize() == 0  # the child never used torch's Redis backend
    assert json.loads(lines["ENV"]) == []  # nothing exported for children to inherit ...
    assert json.loads(lines["FLAGS"]) == [True, True, True]  # ... the switches live in the process's config
    local = parent["store"]["local"]
    # the parent still caches (compiled frames off, the default: FX graphs are entries of their own)
    assert local["aot_autograd"]["writes"] >= 1 and local["fx_graph"]["writes"] >= 1
    assert child_result["losses"] == parent["losses"]
    assert "store" not in child_result


def test_compile_workers_see_the_switches_and_warmstarts_backend(tmp_path):
    """Inductor's compile workers are new Python processes started with the parent's environment
    (WARMSTART=1 included): they run the start-up hook and switch the caches on themselves."""
    probe = tmp_path / "ws_probe_mod.py"
    probe.write_text(
        textwrap.dedent("""
        import os

        def probe():
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config
            import torch._inductor.remote_cache as rc
            from warmstart.compile_cache import get_store

            return {"pid": os.getpid(), "fx": inductor_config.fx_graph_remote_cache,
                    "autograd": functorch_config.enable_remote_autograd_cache,
                    "backend": rc.RemoteFxGraphCache.backend_override_cls.args[0],
                    "store": get_store() is not None,
                    "env": "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE" in os.environ}
    """)
    )
    env = machine_env(tmp_path, WARMSTART="1")
    proc = run_python(
        f"""
        import json, os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import ws_probe_mod
        from torch._inductor.compile_worker.subproc_pool import SubprocPool

        pool = SubprocPool(1)
        try:
            print("WORKER " + json.dumps(pool.submit(ws_probe_mod.probe).result(timeout=300)))
        finally:
            pool.shutdown()
        print("PARENT " + json.dumps(ws_probe_mod.probe()))
    """,
        env,
    )
    lines = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith(("WORKER ", "PARENT "))
    }
    worker, parent = lines["WORKER"], lines["PARENT"]
    assert worker["pid"] != parent["pid"]
    for seen in (worker, parent):
        assert seen == {
            "pid": seen["pid"],
            "fx": True,
            "autograd": True,
            "backend": "fx_graph",
            "store": True,
            "env": False,
        }


def test_the_users_explicit_choice_wins(tmp_path):
    """TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=0 from the user keeps the FX graph remote cache off."""
    env = machine_env(tmp_path, WARMSTART="1", TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="0")
    proc = run_python(
        """
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        print(inductor_config.fx_graph_remote_cache, functorch_config.enable_remote_autograd_cache)
    """,
        env,
    )
    assert proc.stdout.split() == ["False", "True"]


def test_switches_hold_in_every_thread(tmp_path):
    """torch keeps a value set with setattr per thread context: the switches must hold in threads
    other than the one that first imported the config (a compile warm-up thread, then training)."""
    env = machine_env(tmp_path, WARMSTART="1")
    proc = run_python(
        """
        import threading

        seen = []

        def read():
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config
            seen.append((inductor_config.fx_graph_remote_cache, functorch_config.enable_remote_autograd_cache))

        worker = threading.Thread(target=read)  # imports the config modules first, in its own context
        worker.start()
        worker.join()
        read()  # the main thread
        threading.Thread(target=read).start()  # a thread started afterwards
        import time; time.sleep(0.5)
        print(seen)
    """,
        env,
    )
    assert proc.stdout.strip() == "[(True, True), (True, True), (True, True)]"


def test_switches_set_when_torch_was_imported_before_enable(tmp_path):
    """``warmstart.enable()`` after ``import torch``: the config modules are already loaded, and are
    switched on in place; an explicit in-code choice made before is kept."""
    env = machine_env(tmp_path)
    proc = run_python(
        """
        import os
        import torch
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        functorch_config.enable_remote_autograd_cache = False  # the user's choice, in code
        import warmstart
        warmstart.enable()
        print(inductor_config.fx_graph_remote_cache, functorch_config.enable_remote_autograd_cache,
              dynamo_config.automatic_dynamic_remote_pgo, "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE" in os.environ)
    """,
        env,
    )
    assert proc.stdout.split() == ["True", "False", "True", "False"]


def test_switches_go_off_again_if_warmstarts_backend_cannot_be_installed(tmp_path):
    """Were torch's remote-cache hook to change, a switch left on would send this very process to
    torch's Redis backend: warmstart turns off what it turned on, and says so once."""
    env = machine_env(tmp_path, WARMSTART="1")
    proc = run_python(
        """
        from warmstart.compile_cache import torch_hooks

        def broken(remote_cache):
            raise AttributeError("torch moved its remote-cache hook")

        torch_hooks._install_store_backend = broken
        import torch._inductor.config as inductor_config
        before = inductor_config.fx_graph_remote_cache
        import torch._inductor.remote_cache as rc
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        print(before, inductor_config.fx_graph_remote_cache, functorch_config.enable_remote_autograd_cache,
              dynamo_config.automatic_dynamic_remote_pgo, rc.RemoteFxGraphCache.backend_override_cls)
    """,
        env,
    )
    assert proc.stdout.split() == ["True", "None", "None", "None", "None"]
    assert proc.stderr.count("could not hook torch._inductor.remote_cache") == 1


def test_the_vector_isa_probes_child_starts_without_warmstart(tmp_path):
    """Inductor probes each vector ISA by starting a Python that only dlopens a test library; with
    warmstart's start-up hook (and a handover to a preloader) in it, every probe of every process
    cost ~70 ms more. The probes still run, and still find the machine's ISA."""
    env = machine_env(tmp_path, WARMSTART="1")
    del env["TORCHINDUCTOR_VEC_ISA_OK"]  # the probes are what this checks
    proc = run_python(
        """
        import json, os, subprocess
        from torch._inductor import cpu_vec_isa

        probes = []
        original_run = subprocess.run

        def run(cmd, *args, **kwargs):
            if "LoadLibrary" in " ".join(map(str, cmd)):
                child = kwargs["env"]
                probes.append({"warmstart": child.get("WARMSTART"), "ld": child.get("LD_LIBRARY_PATH", "")})
            return original_run(cmd, *args, **kwargs)

        subprocess.run = run
        isa = cpu_vec_isa.pick_vec_isa()
        print("RESULT " + json.dumps({"isa": str(isa), "probes": probes, "here": os.environ.get("WARMSTART")}))
        """,
        env,
    )
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert result["here"] == "1"
    assert result["probes"], result  # a real probe ran
    assert all(p["warmstart"] is None and "torch" in p["ld"] for p in result["probes"]), result
    assert result["isa"] not in ("", "None"), result  # and found an ISA, as without warmstart
