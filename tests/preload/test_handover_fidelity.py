"""A handed-over program against the same command in a new interpreter, as an adversary would try it.

Each case runs one program twice with the same command, environment, directory and input: once
handed over to a real preloader (checked with the preloader's own ``served`` counter) and once
started as usual (``WARMSTART_PRELOAD=0``), and compares what a user can observe: exit status,
output, errors and the files left behind. Where a process cannot be run exactly as a new interpreter
would run it, it must start as usual instead (checked with the ``refused`` counter), and then too
the two runs must agree.
"""

from __future__ import annotations

import gzip
import os
import resource
import shutil
import signal
import subprocess
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
from _wait import until
from test_preload import PY, Preloader

from warmstart.preload import control


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    preloader = Preloader(
        tmp_path_factory.mktemp("fidelity"),
        OMP_NUM_THREADS="1",
        PRELOADER_ONLY_SECRET="s3cr3t-of-the-preloader",
        WARMSTART_PRELOAD_MODULES="sympy",
    ).start()
    yield preloader
    preloader.stop()


def _start(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    """``args`` run as torchrun starts a rank: its own session, no terminal; output captured."""
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, start_new_session=True, **kwargs)


def _counts(node: Preloader) -> tuple[int, int]:
    status = control.status(node.socket) or {}
    return status.get("served", 0), sum(status.get("refused", {}).values())


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def _both(node: Preloader, files: dict[str, str], args: list[str], tmp_path: Path, *, served: bool = True, **kw):
    """Run ``args`` in a fresh copy of ``files`` handed over and as usual; return both results, with
    the files each left, after checking that the preloader served the first (or, ``served`` false,
    that it did not)."""
    results = []
    for handed_over in (True, False):
        work = tmp_path / ("over" if handed_over else "fresh")
        work.mkdir(parents=True)
        for name, text in files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(textwrap.dedent(text))
        before = _counts(node)
        out = node.run(args, preload=handed_over, cwd=work, **kw)
        after = _counts(node)
        if handed_over:
            assert after[0] == before[0] + served, (out.stderr, "handed over" if not served else "not handed over")
        results.append(
            (out.returncode, out.stdout.replace(str(work), "WORK"), out.stderr.replace(str(work), "WORK"), _tree(work))
        )
    return results


def _same(node, files, args, tmp_path, **kw):
    over, fresh = _both(node, files, args, tmp_path, **kw)
    assert over == fresh
    return over


def test_the_working_directory_is_never_on_sys_path_for_a_script(node, tmp_path):
    # A shared directory holding a module another user planted: a script run from there must not
    # import it, as a new interpreter does not.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "job_utils.py").write_text("print('PLANTED CODE RAN')\n")
    app = tmp_path / "app"
    app.mkdir()
    (app / "train.py").write_text(
        "import sys\ntry:\n    import job_utils\nexcept ImportError:\n    print('no job_utils')\nprint(sys.path[0])\n"
    )
    over = node.run([str(app / "train.py")], cwd=shared)
    fresh = node.run([str(app / "train.py")], cwd=shared, preload=False)
    assert (over.returncode, over.stdout) == (fresh.returncode, fresh.stdout) == (0, f"no job_utils\n{app}\n")


@pytest.mark.parametrize("args", [["-c", "import sys; print(sys.path[:2])"], ["-m", "mod"]])
def test_sys_path_is_a_new_interpreters_for_c_and_m(node, tmp_path, args):
    _same(node, {"mod.py": "import sys; print(sys.path[:2])\n"}, args, tmp_path)


def test_a_process_the_program_forks_ends_only_itself(node, tmp_path):
    program = """
        import os, sys
        pid = os.fork()
        if pid == 0:
            print("child exits", flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        print("parent goes on")
        sys.exit(3)
    """
    over = _same(node, {"p.py": program}, ["p.py"], tmp_path)
    assert over[0] == 3 and over[1] == "child exits\nparent goes on\n"


def test_the_interpreter_shuts_down_as_a_new_one_does(node, tmp_path):
    # Finalizers of module-level objects, files left open (a gzip and a zip file are only whole once
    # closed), a temporary file removed by its finalizer, sys.last_value for atexit handlers.
    program = """
        import atexit, gzip, sys, tempfile, zipfile
        class Noisy:
            def __del__(self):
                print("finalized", flush=True)
        keep = Noisy()
        log = gzip.open("log.gz", "wt")
        log.write("line\\n" * 1000)
        archive = zipfile.ZipFile("out.zip", "w")
        archive.writestr("a.txt", "payload")
        scratch = tempfile.NamedTemporaryFile(dir=".", prefix="scratch-", delete=True)
        atexit.register(lambda: print("last:", repr(getattr(sys, "last_value", None)), flush=True))
        raise ValueError("boom")
    """
    over, fresh = _both(node, {"p.py": program}, ["p.py"], tmp_path)
    assert over[:3] == fresh[:3] and sorted(over[3]) == sorted(fresh[3])  # the archives hold their times
    code, out, err, files = over
    assert code == 1 and "ValueError: boom" in err and "last: ValueError('boom')" in out and "finalized" in out
    assert gzip.decompress(files["log.gz"]) == b"line\n" * 1000
    assert not [name for name in files if name.startswith("scratch-")]
    with zipfile.ZipFile(tmp_path / "over" / "out.zip") as archive:
        assert archive.read("a.txt") == b"payload"


def test_a_module_beside_the_script_that_would_shadow_a_preloaded_one_starts_as_usual(node, tmp_path):
    files = {
        "typing_extensions.py": "print('local typing_extensions')\nfrom typing import *\n",
        "p.py": "import torch\n",
    }
    over, fresh = _both(node, files, ["p.py"], tmp_path, served=False)
    assert over[:2] == fresh[:2]


def test_a_zipapp_holding_a_module_that_would_shadow_a_preloaded_one_starts_as_usual(node, tmp_path):
    archive = tmp_path / "app.pyz"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("__main__.py", "import typing_extensions\nprint(typing_extensions.WHO)\n")
        z.writestr("typing_extensions.py", "WHO = 'the zipapp'\n")
    before = _counts(node)
    over, fresh = (node.run([str(archive)], preload=p, cwd=tmp_path) for p in (True, False))
    assert _counts(node)[0] == before[0]
    assert (over.returncode, over.stdout) == (fresh.returncode, fresh.stdout) == (0, "the zipapp\n")


def test_a_module_where_a_preloaded_import_looked_in_vain_starts_as_usual(node, tmp_path):
    # sympy looks for gmpy2 when it is imported (the preloader imported it); a new interpreter
    # importing sympy would find this one.
    files = {"gmpy2.py": "print('local gmpy2')\n", "p.py": "import sympy\nprint('ok')\n"}
    over, fresh = _both(node, files, ["p.py"], tmp_path, served=False)
    assert over[:2] == fresh[:2]


def test_a_sys_path_directory_made_after_the_preloader_started_stales_it(tmp_path):
    later = tmp_path / "later"
    node = Preloader(tmp_path / "p", PYTHONPATH=str(later)).start()
    try:
        later.mkdir()
        (later / "sympy.py").write_text("print('local sympy')\n")
        before = _counts(node)
        over = node.run(["-c", "import sympy"], cwd=tmp_path)
        fresh = node.run(["-c", "import sympy"], cwd=tmp_path, preload=False)
        assert _counts(node)[0] == before[0]
        assert (over.returncode, over.stdout) == (fresh.returncode, fresh.stdout) == (0, "local sympy\n")
    finally:
        node.stop()


def test_a_data_file_a_preloaded_module_read_at_import_is_watched(tmp_path):
    project = tmp_path / "project"
    (project / "lib").mkdir(parents=True)
    (project / "lib" / "conf.json").write_text('{"width": 8}')
    (project / "confmod.py").write_text(
        "import json, os\n"
        "WIDTH = json.load(open(os.path.join(os.path.dirname(__file__), 'lib', 'conf.json')))['width']\n"
    )
    node = Preloader(tmp_path / "p", PYTHONPATH=str(project), WARMSTART_PRELOAD_MODULES="confmod").start()
    try:
        assert "confmod" in node.info["modules"]
        (project / "lib" / "conf.json").write_text('{"width": 16}')
        code = "import confmod; print(confmod.WIDTH)"
        over, fresh = node.run(["-c", code]), node.run(["-c", code], preload=False)
        assert over.stdout == fresh.stdout == "16\n"
        assert node.status()["served"] == 0
    finally:
        node.stop()


def test_the_preloaders_environment_and_a_programs_secrets_reach_no_program(node, tmp_path):
    secret = os.urandom(16).hex()
    before = _counts(node)
    node.run(["-c", "import os; x = os.environ['JOB_SECRET'] * 3"], extra_env={"JOB_SECRET": secret}, cwd=tmp_path)
    assert _counts(node)[0] == before[0] + 1
    # A later sibling reads its own start-up environment and scans its own memory for the first's
    # secret, given in two halves: the whole never exists in its own memory unless it was inherited.
    scan = """
        import os, sys
        environ = open("/proc/self/environ", "rb").read()
        found = b"-of-the-preloader" in environ
        head, tail = sys.argv[1].encode(), sys.argv[2].encode()

        def holds(data):
            at = data.find(head)
            while at >= 0:
                if data[at + len(head) : at + len(head) + len(tail)] == tail:
                    return True
                at = data.find(head, at + 1)
            return False

        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps:
                fields = line.split()
                if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] in ("[heap]", "[stack]")):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    try:
                        mem.seek(start)
                        found = found or holds(mem.read(end - start))
                    except OSError:
                        pass
        print("found" if found else "clean")
    """
    (tmp_path / "scan.py").write_text(textwrap.dedent(scan))
    before = _counts(node)
    out = node.run(["scan.py", secret[:16], secret[16:]], cwd=tmp_path)
    assert _counts(node)[0] == before[0] + 1
    assert (out.returncode, out.stdout) == (0, "clean\n"), out.stderr


def test_no_descriptor_of_the_interpreters_start_or_of_the_handover_reaches_the_program(node, tmp_path):
    _same(node, {"p.py": "import os\nprint(sorted(os.listdir('/proc/self/fd')))\n"}, ["p.py"], tmp_path)


@pytest.mark.parametrize(
    "env", [{}, {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2"}]
)
def test_torchs_thread_count_is_the_programs(node, tmp_path, env):
    # The preloader imported torch with OMP_NUM_THREADS=1.
    base = {**node.client_env(**env)}
    if "OMP_NUM_THREADS" not in env:
        base.pop("OMP_NUM_THREADS", None)
    results = []
    before = _counts(node)
    for preload in (True, False):
        if not preload:
            base["WARMSTART_PRELOAD"] = "0"
        out = _start([PY, "-c", "import torch; print(torch.get_num_threads())"], base)
        results.append((out.returncode, out.stdout))
        if preload:
            assert _counts(node)[0] == before[0] + 1, out.stderr
    assert results[0] == results[1]


def test_standard_streams_are_a_new_interpreters(node, tmp_path):
    program = "import sys\nprint(repr(sys.stdin.read()))\nprint(sys.stdin.newlines, sys.stdout.line_buffering)\n"
    _same(node, {"p.py": program}, ["p.py"], tmp_path, input="a\rb\r\nc\n")
    # unbuffered: what was written is out, whatever ends the process
    program = "import os, sys\nsys.stdout.buffer.write(b'written')\nos._exit(0)\n"
    for args in (["-u", "p.py"], ["p.py"]):
        _same(node, {"p.py": program}, args, tmp_path / args[0].strip("-."), extra_env={})
    # PYTHONUNBUFFERED is read when the interpreter starts: handed over where the preloader has it too
    served = node.env.get("PYTHONUNBUFFERED") == "1"
    _same(node, {"p.py": program}, ["p.py"], tmp_path / "env", extra_env={"PYTHONUNBUFFERED": "1"}, served=served)
    without = {k: v for k, v in node.client_env().items() if k != "PYTHONUNBUFFERED"}
    over, fresh = (
        _start([PY, "p.py"], {**without, **({} if p else {"WARMSTART_PRELOAD": "0"})}, cwd=tmp_path / "env" / "over")
        for p in (True, False)
    )
    assert over.stdout == fresh.stdout  # no PYTHONUNBUFFERED: what was buffered is lost in both


def test_a_reader_that_closed_its_end_fails_the_program_as_it_would(node, tmp_path):
    (tmp_path / "p.py").write_text("for i in range(100000):\n    print('x' * 80)\n")
    statuses = []
    for preload in (True, False):
        env = node.client_env(**({} if preload else {"WARMSTART_PRELOAD": "0"}))
        out = _start(["bash", "-c", f"{PY} p.py | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}"], env, cwd=tmp_path)
        statuses.append((out.stdout, "BrokenPipeError" in out.stderr))
    assert statuses[0] == statuses[1]


def test_scripts_the_interpreter_itself_opens_or_runs_as_bytecode(node, tmp_path):
    over, fresh = _both(node, {}, ["missing.py"], tmp_path, served=False)
    assert over[0] == fresh[0] == 2 and over[2] == fresh[2] and "can't open file" in over[2]
    import py_compile

    source = tmp_path / "src.py"
    source.write_text("print('from bytecode')\n")
    compiled = py_compile.compile(str(source), cfile=str(tmp_path / "compiled.pyc"))
    over, fresh = (node.run([compiled], preload=p, cwd=tmp_path) for p in (True, False))
    assert (over.returncode, over.stdout) == (fresh.returncode, fresh.stdout) == (0, "from bytecode\n")


def test_a_script_under_a_linked_directory_gets_the_resolved_path(node, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "p.py").write_text("import sys\nprint(sys.path[0])\n")
    (tmp_path / "linked").symlink_to(real)
    over, fresh = (node.run([str(tmp_path / "linked" / "p.py")], preload=p, cwd=tmp_path) for p in (True, False))
    assert over.stdout == fresh.stdout == f"{real}\n"


def test_what_the_imports_made_of_the_working_directory_is_the_programs(node, tmp_path):
    code = (
        "import multiprocessing.process as mp, torch._dynamo.config as c, torch._inductor.config as i; "
        "print(mp.ORIGINAL_DIR, c.debug_dir_root, i.xpu.cutlass_dir)"
    )
    over = _same(node, {}, ["-c", code], tmp_path)
    assert over[1].split()[0] == "WORK"


def test_generators_seeded_at_import_draw_anew_in_every_program(node, tmp_path):
    code = "import sympy.core.random as r; print(r.rng.random())"
    draws = {node.run(["-c", code], cwd=tmp_path).stdout for _ in range(3)}
    assert len(draws) == 3


@pytest.mark.parametrize(
    "variable", [{"GLIBC_TUNABLES": "glibc.malloc.check=3"}, {"MALLOC_PERTURB_": "165"}, {"SYMPY_USE_CACHE": "no"}]
)
def test_variables_read_when_the_process_or_its_imports_start_make_it_start_as_usual(node, tmp_path, variable):
    before = _counts(node)
    out = node.run(["-c", "print('ran')"], extra_env=variable, cwd=tmp_path)
    assert out.stdout == "ran\n" and _counts(node)[0] == before[0]


def test_a_stack_limit_other_than_the_preloaders_starts_as_usual(node, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    limit = 64 << 20 if hard == resource.RLIM_INFINITY or hard >= 64 << 20 else hard // 2
    before = _counts(node)
    out = node.run(
        ["-c", "print('ran')"],
        cwd=tmp_path,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_STACK, (limit, hard)),
    )
    assert out.stdout == "ran\n" and _counts(node)[0] == before[0]


def test_a_personality_other_than_the_preloaders_starts_as_usual(node, tmp_path):
    if not shutil.which("setarch"):
        pytest.skip("setarch is not installed")
    before = _counts(node)
    env = node.client_env()
    out = _start(
        ["setarch", os.uname().machine, "-R", PY, "-c", "print(open('/proc/self/personality').read().strip())"], env
    )
    assert out.returncode == 0 and out.stdout.strip() != "00000000" and _counts(node)[0] == before[0]


def test_an_idle_connection_holds_up_no_other_start(node, tmp_path):
    import socket

    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(node.socket)
    idle.send(b"\x00\x00")  # half a header, then nothing
    try:
        before = _counts(node)
        started = time.monotonic()
        out = node.run(["-c", "print('ran')"], cwd=tmp_path)
        assert out.stdout == "ran\n" and _counts(node)[0] == before[0] + 1
        assert time.monotonic() - started < 1.5
    finally:
        idle.close()


def test_a_signal_to_the_launchers_process_group_reaches_the_programs_children(node, tmp_path):
    # torchrun stops each rank with killpg: in a plain run the rank's own children are in its group.
    program = (
        "import subprocess, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)\n"
    )
    (tmp_path / "p.py").write_text(program)
    for preload in (True, False):
        env = node.client_env(**({} if preload else {"WARMSTART_PRELOAD": "0"}))
        proc = subprocess.Popen(
            [PY, "p.py"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        sleeper = int(proc.stdout.readline())
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        until(lambda pid=sleeper: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=10)
        proc.stdout.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_shell_with_no_locale_gets_a_preloader_that_serves_it(tmp_path):
    # Python coerces the C locale in `warmstart preload start` itself (LC_CTYPE=C.UTF-8 in its
    # environment); the programs the shell starts have no LC_CTYPE and run in UTF-8 mode.
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "WARMSTART", "PYTEST"))}
    sock = str(tmp_path / "p" / "preload.sock")
    (tmp_path / "p").mkdir(mode=0o700)
    env = {**bare, "WARMSTART_PRELOAD_SOCKET": sock}
    start = subprocess.run([PY, "-m", "warmstart", "preload", "start"], env=env, capture_output=True, timeout=300)
    assert start.returncode == 0, start.stderr
    try:
        client = {**env, "WARMSTART": "1"}
        doctor = subprocess.run(
            [PY, "-m", "warmstart", "cache", "doctor", "--json"],
            env=client,
            capture_output=True,
            text=True,
            timeout=300,
        )
        before = control.status(sock)["served"]
        out = _start([PY, "-c", "import sys; print(sys.flags.utf8_mode)"], client)
        assert out.stdout == "1\n"
        assert control.status(sock)["served"] == before + 1, (control.status(sock), doctor.stdout)
        assert '"handed over' in doctor.stdout or "handed over" in doctor.stdout
    finally:
        subprocess.run([PY, "-m", "warmstart", "preload", "stop", "--socket", sock], env=env, timeout=60)


def test_a_stopped_process_stops_its_program(node, tmp_path):
    # SIGSTOP cannot be caught and passed on: the preloader sees the process stopped and stops its
    # program within STOP_CHECK_S, and lets it go on with it.
    from warmstart.preload.server import STOP_CHECK_S

    program = "import time\nwhile True:\n    print(time.time(), flush=True)\n    time.sleep(0.005)\n"
    (tmp_path / "p.py").write_text(program)
    written = {}
    for preload in (True, False):
        log = tmp_path / f"log-{preload}"
        env = node.client_env(**({} if preload else {"WARMSTART_PRELOAD": "0"}))
        with open(log, "w") as out:
            proc = subprocess.Popen([PY, "p.py"], env=env, cwd=tmp_path, stdout=out, start_new_session=True)
            until(lambda log=log: log.stat().st_size > 0, timeout=60)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.3)  # the last lines before the stop: written
            stopped_at = time.time()
            time.sleep(1.0)
            resumed_at = time.time()
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.3)
            proc.terminate()
            proc.wait(timeout=30)
        stamps = [float(line) for line in log.read_text().split()]
        written[preload] = [t for t in stamps if stopped_at <= t <= resumed_at]
        assert [t for t in stamps if t > resumed_at], "the program did not go on"
    assert written[False] == []
    assert written[True] == [], f"{len(written[True])} lines while stopped (checked every {STOP_CHECK_S} s)"


def test_a_process_in_another_session_keyring_starts_as_usual(node, tmp_path):
    # keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL): a new anonymous session keyring, then the program.
    code = (
        "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
        "assert libc.syscall({'x86_64': 250, 'aarch64': 219}[os.uname().machine], 1, None) > 0; "
        "os.environ['WARMSTART_PRELOAD'] = '1'; "
        "os.execv(sys.executable, [sys.executable, '-c', 'print(\"ran\")'])"
    )
    before = _counts(node)
    out = node.run(["-c", code], preload=False, cwd=tmp_path)
    assert out.stdout == "ran\n", out.stderr
    assert _counts(node) == (before[0], before[1] + 1)


def test_what_differs_is_what_is_documented(node, tmp_path):
    # Each row of docs/preload.md's "What differs" table, as it says.
    from warmstart.preload import environment

    program = """
        import ctypes, json, os, resource, sys
        libc = ctypes.CDLL(None, use_errno=True)
        sig = ctypes.c_int()
        libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        environ = [e.split(b"=", 1) for e in open("/proc/self/environ", "rb").read().split(b"\\0") if e]

        def setsid():
            try:
                os.setsid()
                return "ok"
            except OSError as exc:
                return exc.strerror
        print(json.dumps({
            "pid": os.getpid(), "sid": os.getsid(0), "pgrp": os.getpgrp(), "ppid": os.getppid(),
            "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
            "environ": {k.decode(): v.decode(errors="replace") for k, v in environ},
            "pdeathsig": sig.value, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "hash": hash("warmstart"), "frozen": __import__("gc").get_freeze_count(),
            "setsid": setsid(), "started": int(open("/proc/self/stat").read().rpartition(")")[2].split()[19]),
        }))
        import time
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
    """
    (tmp_path / "p.py").write_text(textwrap.dedent(program))
    import json

    seen = {}
    for preload in (True, True, False):
        env = node.client_env(**({} if preload else {"WARMSTART_PRELOAD": "0"}))
        proc = subprocess.Popen(
            [PY, "p.py"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        launcher_started = int(Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[19])
        out = json.loads(proc.stdout.readline())
        _, status, usage = os.wait4(proc.pid, 0)
        proc.stdout.close()
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0
        out["launcher"], out["cpu_s"] = proc.pid, usage.ru_utime + usage.ru_stime
        out["launcher_started"] = launcher_started
        seen.setdefault(preload, []).append(out)
    preloader_pid = node.status()["pid"]
    preloader_cmdline = Path(f"/proc/{preloader_pid}/cmdline").read_bytes().decode(errors="replace")
    for over in seen[True]:
        assert over["pid"] == over["sid"] == over["pgrp"] != over["launcher"]
        assert over["ppid"] == preloader_pid
        assert over["cmdline"] == preloader_cmdline
        assert over["pdeathsig"] == signal.SIGKILL
        assert over["maxrss_kib"] > 200_000  # the preloader's size, torch imported
        assert over["cpu_s"] < 0.2  # the launcher's own, not the program's 0.3 s
        for name, value in over["environ"].items():
            ours = name == "PATH" or name.startswith("WARMSTART")
            assert ours or environment.import_time_environment({name: value}), name
            if not ours:
                assert value == node.client_env().get(name), name  # the program's own value
        assert "PRELOADER_ONLY_SECRET" not in over["environ"]
        assert over["frozen"] > 100_000
        assert over["setsid"] == "Operation not permitted" and over["started"] > over["launcher_started"]
    fresh = seen[False][0]
    assert fresh["pid"] == fresh["launcher"] and fresh["ppid"] == os.getpid()
    assert fresh["pdeathsig"] == 0 and fresh["cpu_s"] >= 0.25 and fresh["frozen"] == 0
    assert fresh["setsid"] == "Operation not permitted"  # started as torchrun starts a rank: leading its group
    assert fresh["started"] == fresh["launcher_started"]
    assert seen[True][0]["hash"] == seen[True][1]["hash"]  # one PYTHONHASHSEED for the preloader's children


def test_doctor_says_what_only_a_child_can_tell(node, tmp_path):
    # A variable the preloaded modules read (LOGLEVEL, read by torch.distributed.elastic) is only
    # compared in the child: doctor asks a child, and says what the next process would get.
    env = {**node.client_env(), "LOGLEVEL": "INFO"}
    doctor = subprocess.run(
        [PY, "-m", "warmstart", "cache", "doctor"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "preloader: not handed over" in doctor.stdout and "LOGLEVEL" in doctor.stdout, doctor.stdout
    before = _counts(node)
    out = _start([PY, "-c", "print('ran')"], env, cwd=tmp_path)
    assert out.stdout == "ran\n" and _counts(node) == (before[0], before[1] + 1)


def test_the_launchers_timer_slack_is_the_programs(node, tmp_path):
    import ctypes

    def slack():
        ctypes.CDLL(None, use_errno=True).prctl(29, 123_456, 0, 0, 0)  # PR_SET_TIMERSLACK

    program = "import ctypes\nprint(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))\n"  # PR_GET_TIMERSLACK
    (tmp_path / "p.py").write_text(program)
    before = _counts(node)
    over, fresh = (node.run(["p.py"], preload=p, cwd=tmp_path, preexec_fn=slack) for p in (True, False))
    assert _counts(node)[0] == before[0] + 1
    assert over.stdout == fresh.stdout == "123456\n", (over.stderr, fresh.stderr)


@pytest.mark.parametrize("status", [213, 0])
def test_a_program_may_exit_with_any_status_the_preloader_uses_itself(node, tmp_path, status):
    # The preloader tells a declined child by why it wrote, not by its exit status.
    before = _counts(node)
    over = _same(node, {"p.py": f"import sys\nsys.exit({status})\n"}, ["p.py"], tmp_path)
    assert over[0] == status and _counts(node) == (before[0] + 1, before[1])
