"""The preloader against real processes: a real preloader (torch, TorchRec and the compiler
imported), real programs handed over by the interpreter's start-up hook, real signals.

Whether a program ran in a preloader's child is read from inside it (``warmstart._launch``), and
every handed-over run is compared with the same program started as usual.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _wait import until

PY = sys.executable
FORKED = "import warmstart._launch as _l; _forked = _l.forked_start_ts is not None"
#: What a program that waits for a signal runs once it said it is ready. Not one ``time.sleep(60)``: a
#: signal that arrives after the interpreter's last check for pending signals and before the sleep
#: starts is handled only when the sleep ends. Short sleeps bound that to 0.1 s.
SLEEP_A_MINUTE = "\nfor _ in range(600): time.sleep(0.1)"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "PYTEST"))}
    env.update(extra)
    return env


class Preloader:
    """A preloader on its own socket, started and stopped with the commands a user runs."""

    def __init__(self, directory: Path, **extra_env: str) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket = str(directory / "preload.sock")
        self.env = _clean_env(WARMSTART_PRELOAD_SOCKET=self.socket, **extra_env)
        self.run_dir = directory / "runs"  # what the programs record, kept out of the working directory

    def start(self) -> Preloader:
        out = subprocess.run(
            [PY, "-m", "warmstart", "preload", "start", "--json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        self.info = json.loads(out.stdout)
        assert self.info["fork_safe"], self.info
        return self

    def status(self) -> dict:
        out = subprocess.run(
            [PY, "-m", "warmstart", "preload", "status", "--json", "--socket", self.socket],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        found = json.loads(out.stdout)["preloaders"]
        return found[0] if found else {}

    def stop(self) -> None:
        subprocess.run(
            [PY, "-m", "warmstart", "preload", "stop", "--socket", self.socket],
            env=self.env,
            capture_output=True,
            timeout=60,
        )

    def client_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, "WARMSTART": "1", "WARMSTART_RUN_DIR": str(self.run_dir), **extra}

    def run(self, args: list[str], *, preload: bool = True, extra_env: dict | None = None, **kwargs):
        env = self.client_env(**(extra_env or {}))
        if not preload:
            env["WARMSTART_PRELOAD"] = "0"
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 120)
        # As torchrun, Slurm and Kubernetes start ranks: without a controlling terminal, which a process
        # started at one (pytest run at a shell) would have, and which keeps it from being handed over.
        kwargs.setdefault("start_new_session", True)
        return subprocess.run([PY, *args], env=env, **kwargs)


@pytest.fixture(scope="module")
def preloader(tmp_path_factory):
    node = Preloader(tmp_path_factory.mktemp("preload"), TORCHINDUCTOR_COMPILE_THREADS="2").start()
    yield node
    node.stop()


def _report(*names: str) -> str:
    return (
        FORKED
        + "; import json, os, sys; print(json.dumps({'forked': _forked, "
        + ", ".join(f"{n!r}: {n}" for n in names)
        + "}))"
    )


def test_command_script_and_module_run_as_python_runs_them(preloader, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    body = _report(
        "sys.argv",
        "os.getcwd()",
        "sys.path[0]",
        "__name__",
        "__file__ if '__file__' in dir() else None",
        "__spec__.name if __spec__ else None",
        "type(__builtins__).__name__",
        "__loader__.__class__.__name__",
        "sorted(k for k in dir() if not k.startswith('_f'))",
    )
    (tmp_path / "pkg" / "mod.py").write_text(body + "\n")
    (tmp_path / "script.py").write_text(body + "\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(body + "\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "pkg" / "mod.py")
    for args in (
        [
            "-c",
            _report(
                "sys.argv",
                "os.getcwd()",
                "sys.path[0]",
                "__name__",
                "type(__builtins__).__name__",
                "__loader__.__name__",
                "sorted(dir())",
            ),
            "a",
            "b",
        ],
        ["script.py", "x", "--y"],
        ["-m", "pkg.mod", "z"],
        ["-u", "script.py"],
        ["./app/../app", "q"],
        ["link.py"],
    ):
        forked = preloader.run(args, cwd=tmp_path)
        plain = preloader.run(args, cwd=tmp_path, preload=False)
        assert forked.returncode == plain.returncode == 0, (forked.stderr, plain.stderr)
        got, want = json.loads(forked.stdout), json.loads(plain.stdout)
        assert got.pop("forked") and not want.pop("forked"), args
        assert got == want, args
    # Interpreter options the preloader's own interpreter lacks: started as usual, and the same.
    other = preloader.run(["-X", "utf8=0", "script.py"], cwd=tmp_path)
    assert other.returncode == 0 and json.loads(other.stdout)["forked"] is False


def test_exit_status_and_tracebacks_are_the_programs(preloader, tmp_path):
    (tmp_path / "fails.py").write_text("def f():\n    raise KeyError('boom')\nf()\n")
    cases = [
        ["-c", "import sys; sys.exit(7)"],
        ["-c", "raise SystemExit('a message')"],
        ["fails.py"],
        ["-c", "import os; os._exit(3)"],
    ]
    for args in cases:
        forked, plain = preloader.run(args, cwd=tmp_path), preloader.run(args, cwd=tmp_path, preload=False)
        assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr), args
    served = preloader.status()["served"]
    assert served >= len(cases)


def test_standard_streams_and_a_pipe_through_the_child(preloader):
    code = (
        FORKED
        + "; import sys; data = sys.stdin.read(); print(data.upper(), end=''); print('err', _forked, file=sys.stderr)"
    )
    out = preloader.run(["-c", code], input="line one\nline two\n")
    assert out.returncode == 0
    assert out.stdout == "LINE ONE\nLINE TWO\n"
    assert out.stderr == "err True\n"
    # A pipeline: the reader sees the end of its input when the child's program ends.
    producer = subprocess.Popen(
        [PY, "-c", "print('\\n'.join(map(str, range(1000))))"],
        env=preloader.client_env(),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    consumer = subprocess.run(
        [PY, "-c", "import sys; print(sum(int(x) for x in sys.stdin))"],
        env=preloader.client_env(),
        stdin=producer.stdout,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    producer.stdout.close()
    assert producer.wait(timeout=60) == 0
    assert consumer.stdout.strip() == str(sum(range(1000)))
    # The streams themselves as the interpreter makes them: encodings, error handlers, buffering.
    report = _report(
        "[(s.name, s.mode, s.encoding, s.errors, s.line_buffering, s.write_through)"
        " for s in (sys.stdin, sys.stdout, sys.stderr)]"
    )
    forked, usual = (json.loads(preloader.run(["-c", report], preload=p).stdout) for p in (True, False))
    assert (forked.pop("forked"), usual.pop("forked")) == (True, False)
    assert forked == usual


#: Runs a program with WARMSTART=1 in a session of its own whose controlling terminal is the
#: pseudo-terminal whose descriptor is argv[1], as a shell at that terminal would. A new interpreter (started
#: without WARMSTART, so never handed over itself), so that no Python runs between a fork of the
#: test's threaded process and an exec.
_AT_A_TERMINAL = (
    "import fcntl, os, sys, termios; os.setsid(); fd = int(sys.argv[1]); fcntl.ioctl(fd, termios.TIOCSCTTY, 0)\n"
    "for n in range(3): os.dup2(fd, n)\n"
    "os.close(fd); os.execve(sys.argv[2], sys.argv[2:], {**os.environ, 'WARMSTART': '1'})"
)


def test_a_program_started_at_a_terminal_starts_as_usual(preloader):
    # A forked child runs in a session of its own, with no controlling terminal: /dev/tty would not
    # open (getpass would echo a password).
    import select

    code = FORKED + "\nimport os\nos.close(os.open('/dev/tty', os.O_RDWR))\nprint(_forked, os.isatty(0))"
    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        [PY, "-c", _AT_A_TERMINAL, str(terminal), PY, "-c", code],
        env={k: v for k, v in preloader.client_env().items() if k != "WARMSTART"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(terminal,),
    )
    os.close(terminal)
    output, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if not select.select([controller], [], [], 1.0)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(controller, 1024)
            except OSError:  # EIO: the program ended and its terminal closed
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(controller)
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        status = proc.wait(timeout=60)
    assert status == 0, (output, proc.stderr.read())
    assert output.decode().split() == ["False", "True"]


def test_sigterm_is_forwarded_and_a_signal_death_is_the_same(preloader):
    code = FORKED + textwrap.dedent("""
        import os, signal, sys, time
        def on_term(*_):
            print('terminated', _forked, flush=True)
            sys.exit(42)
        signal.signal(signal.SIGTERM, on_term)
        os.write(1, b'ready\\n')  # not print(): the handler prints, and must not interrupt a print
        for _ in range(600):  # short sleeps: see SLEEP_A_MINUTE
            time.sleep(0.1)
    """)
    proc = subprocess.Popen(
        [PY, "-c", code], env=preloader.client_env(), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42
    assert proc.stdout.read() == "terminated True\n"
    # Killed by a signal: the original process ends by the same signal.
    died = preloader.run(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR2)"])
    assert died.returncode == -signal.SIGUSR2


def test_sigint_ends_the_program_as_keyboardinterrupt_does(preloader):
    code = FORKED + "; import os, time; os.write(1, f'ready {_forked}\\n'.encode())" + SLEEP_A_MINUTE
    results = []
    for preload in (True, False):
        env = preloader.client_env(**({} if preload else {"WARMSTART_PRELOAD": "0"}))
        # SIGINT as a terminal leaves it (a shell's background job, CI, has it ignored, and a process
        # that starts with it ignored keeps it so, handed over or not)
        proc = subprocess.Popen(
            [PY, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_sigint_default,
        )
        assert proc.stdout.readline() == f"ready {preload}\n"
        proc.send_signal(signal.SIGINT)
        results.append((proc.wait(timeout=30), proc.stderr.read().splitlines()[-1]))
    assert results[0] == results[1] == (-signal.SIGINT, "KeyboardInterrupt")


_WAIT_WITH_A_SIGNAL = """
import json, os, resource, signal, socket, threading, time
import _signal
from warmstart.preload import client

handled = []
signal.signal(signal.SIGUSR1, lambda *_: handled.append(True))
program_end, waiting = socket.socketpair()
# A process may hold many descriptors: the wait's are numbered past select()'s 1024 here.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard == resource.RLIM_INFINITY or hard >= 2048:
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    waiting = socket.socket(fileno=os.dup2(waiting.detach(), 1500))
wakeup = client._signal_wakeup(_signal)

def end_program():
    report["handled before the program ended"] = bool(handled)
    program_end.send(b"x")

report = {}
# Raised in another thread, the signal interrupts none of the main thread's system calls: what the
# main thread sees of a signal that arrives just before its wait starts.
threading.Timer(0.2, signal.raise_signal, [signal.SIGUSR1]).start()
threading.Timer(5.0, end_program).start()
client._until_readable(waiting, wakeup)  # then the message, as the process's wait reads it
waiting.recv(1)
print(json.dumps(report))
"""


def test_a_signal_that_interrupts_no_system_call_is_still_forwarded_at_once():
    """The handed-over process waits for the program's end: a signal that arrives while its wait
    starts is forwarded then, not once the program has ended."""
    out = subprocess.run([PY, "-c", _WAIT_WITH_A_SIGNAL], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"handled before the program ended": True}


def test_sigkill_of_the_original_ends_the_child(preloader):
    code = FORKED + "; import os, time; print(os.getpid(), _forked, flush=True); time.sleep(120)"
    proc = subprocess.Popen(
        [PY, "-c", code], env=preloader.client_env(), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child_pid, forked = proc.stdout.readline().split()
    assert forked == "True" and int(child_pid) != proc.pid
    proc.kill()
    proc.wait(timeout=30)
    until(lambda: not _alive(int(child_pid)), timeout=10)  # the preloader kills it at once


def test_faulthandler_dumps_on_sigusr1(preloader):
    code = FORKED + textwrap.dedent("""
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1)
        def waiting_here():
            print('ready', _forked, flush=True)
            time.sleep(3)
        waiting_here()
    """)
    proc = subprocess.Popen(
        [PY, "-c", code],
        env=preloader.client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline() == "ready True\n"
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "in waiting_here" in err


def test_an_import_time_variable_that_differs_is_not_handed_over(preloader):
    before = preloader.status()["refused"]
    out = preloader.run(["-c", FORKED + "; print(_forked)"], extra_env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert out.returncode == 0 and out.stdout == "False\n"
    refused = preloader.status()["refused"]
    assert sum(refused.values()) == sum(before.values()) + 1
    assert any("TORCHINDUCTOR_MAX_AUTOTUNE" in reason for reason in refused)
    # The C++ compiler: torch._inductor.config reads CXX when it is imported.
    code = FORKED + "; from torch._inductor import config; print(_forked, config.cpp.cxx[1])"
    out = preloader.run(["-c", code], extra_env={"CXX": "c++"})
    assert (out.returncode, out.stdout) == (0, "False c++\n"), out.stderr
    assert any("CXX" in reason for reason in preloader.status()["refused"])
    # Variables read after import are the program's own: handed over, and set in the child.
    out = preloader.run(
        ["-c", FORKED + "; import os; print(_forked, os.environ['MY_SETTING'])"], extra_env={"MY_SETTING": "v1"}
    )
    assert out.stdout == "True v1\n"


def test_preload_turned_off_or_set_to_a_value_not_valid_is_never_handed_over(preloader):
    out = preloader.run(["-c", FORKED + "; print(_forked)"], extra_env={"WARMSTART_PRELOAD": "0"})
    assert (out.returncode, out.stdout, out.stderr) == (0, "False\n", "")
    # "false" reads as "off" to a person: it must not hand the process over, and it is said.
    out = preloader.run(["-c", FORKED + "; print(_forked)"], extra_env={"WARMSTART_PRELOAD": "false"})
    assert (out.returncode, out.stdout) == (0, "False\n"), out.stderr
    assert out.stderr.strip().splitlines() == [
        "warmstart: disabled in this process: WARMSTART_PRELOAD='false' is not valid: expected 0 (never hand a "
        "process over to a preloader), 1 or unset (do when one serves)"
    ]


def test_a_sys_path_directory_stales_the_preloader_only_when_what_can_be_imported_there_changes(tmp_path):
    # A project root on sys.path (an editable install, PYTHONPATH=.), where a job writes its logs,
    # run directories and caches: none of that changes what a new interpreter imports.
    project = tmp_path / "project"
    project.mkdir()
    node = Preloader(tmp_path / "p", PYTHONPATH=str(project)).start()
    code = FORKED + "; print(_forked)"
    try:
        (project / "run.log").write_text("step 1\n")
        (project / "warmstart-runs").mkdir()
        (project / ".hypothesis").mkdir()
        (project / "notes.v2.txt").write_text("")
        (project / "__pycache__").mkdir()  # a module there imported for the first time
        assert not node.status()["stale"]
        out = node.run(["-c", code])
        assert (out.returncode, out.stdout) == (0, "True\n"), out.stderr
        # A module there could shadow one the preloader imported, or satisfy an import that failed.
        (project / "torchrec_extras.py").write_text("")
        assert str(project) in node.status()["stale"]
        out = node.run(["-c", code])
        assert (out.returncode, out.stdout) == (0, "False\n"), out.stderr
    finally:
        node.stop()


def test_a_module_edited_just_before_a_launch_is_never_run_from_its_old_import(tmp_path):
    # The preloader is told of every change on a local filesystem as it happens: no request is
    # served from a check made before the edit, however recent, and an idle preloader checks nothing.
    from warmstart.preload.watch import LOCAL_FILESYSTEMS, filesystem_of, filesystem_types

    if filesystem_of(str(tmp_path), filesystem_types()) not in LOCAL_FILESYSTEMS:
        pytest.skip("the test directory is on a filesystem whose changes are polled")
    project = tmp_path / "project"
    project.mkdir()
    (project / "trainer_mod.py").write_text("WIDTH = 8\n")
    node = Preloader(tmp_path / "p", PYTHONPATH=str(project), WARMSTART_PRELOAD_MODULES="trainer_mod").start()
    code = FORKED + "; import trainer_mod; print(_forked, trainer_mod.WIDTH)"
    try:
        assert "trainer_mod" in node.info["modules"]
        out = node.run(["-c", code])
        assert (out.returncode, out.stdout) == (0, "True 8\n"), out.stderr
        files = node.status()["files"]  # a status checks every file, and counts it
        assert files["polled_files"] == 0 and files["watched_directories"] > 0, files
        time.sleep(1.5)  # three idle rounds of the serve loop
        assert node.status()["files"]["full_checks"] == files["full_checks"] + 1
        (project / "trainer_mod.py").write_text("WIDTH = 16\n")
        out = node.run(["-c", code])  # at once, well within a second of the last full check
        assert (out.returncode, out.stdout) == (0, "False 16\n"), out.stderr
        assert any("trainer_mod.py changed" in reason for reason in node.status()["refused"])
    finally:
        node.stop()


_DRAWS = ("torch.rand(3).tolist()", "torch.initial_seed()", "random.random()", "numpy.random.rand()")
_DRAW = "import random, numpy, torch; " + _report(*_DRAWS)


def test_every_forked_program_gets_fresh_random_seeds_and_keys_as_a_new_interpreter_does(preloader):
    # torch seeds its CPU generator from the OS's entropy in every new interpreter; a child that
    # kept the preloader's would draw what every other rank and restart draws. multiprocessing makes
    # its authentication key at import: one per program, not one per preloader.
    own = ("multiprocessing.current_process().authkey.hex()", "threading.main_thread().native_id == os.getpid()")
    code = "import multiprocessing, threading, random, numpy, torch; " + _report(*_DRAWS, *own)
    runs = [preloader.run(["-c", code]) for _ in range(2)] + [preloader.run(["-c", code], preload=False)]
    assert all(out.returncode == 0 for out in runs), [out.stderr for out in runs]
    first, second, usual = (json.loads(out.stdout) for out in runs)
    assert (first["forked"], second["forked"], usual["forked"]) == (True, True, False)
    for key in (*_DRAWS, own[0]):
        assert len({json.dumps(first[key]), json.dumps(second[key]), json.dumps(usual[key])}) == 3, key
    assert first[own[1]] is second[own[1]] is usual[own[1]] is True


def test_a_forked_programs_logging_starts_unconfigured_as_in_a_new_interpreter(preloader):
    # fbgemm_gpu, under TorchRec, logs when the preloader imports it, which configures the root
    # logger; a program's own basicConfig() must still take effect.
    code = FORKED + (
        "; import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); logging.info(_forked)"
    )
    forked, usual = (preloader.run(["-c", code], preload=p) for p in (True, False))
    assert (forked.returncode, forked.stderr, usual.returncode, usual.stderr) == (0, "True\n", 0, "False\n")


def test_a_preloaded_modules_effects_at_import_reach_each_child_as_if_it_imported_it_first(tmp_path):
    # As a new interpreter that imports the modules first: seeded, then two numbers drawn; the root
    # logger configured.
    project = tmp_path / "project"
    project.mkdir()
    (project / "seeds_at_import.py").write_text("import torch\ntorch.manual_seed(7)\nPROJECTION = torch.rand(2)\n")
    (project / "logs_at_import.py").write_text(
        "import logging\nlogging.basicConfig(level=logging.INFO, format='configured: %(message)s')\n"
    )
    node = Preloader(
        tmp_path / "p", PYTHONPATH=str(project), WARMSTART_PRELOAD_MODULES="seeds_at_import,logs_at_import"
    ).start()
    code = "import seeds_at_import, logs_at_import, logging; logging.info('x'); " + _DRAW
    try:
        assert {"seeds_at_import", "logs_at_import"} <= set(node.info["modules"])
        runs = [node.run(["-c", code]), node.run(["-c", code]), node.run(["-c", code], preload=False)]
        assert all(out.returncode == 0 for out in runs), [out.stderr for out in runs]
        assert [out.stderr for out in runs] == ["configured: x\n"] * 3
        first, second, usual = (json.loads(out.stdout) for out in runs)
        assert (first["forked"], second["forked"], usual["forked"]) == (True, True, False)
        for key in ("torch.rand(3).tolist()", "torch.initial_seed()"):
            assert first[key] == second[key] == usual[key], key
        assert first["random.random()"] != second["random.random()"]
    finally:
        node.stop()


def test_modules_a_preloader_could_not_import_or_was_not_started_with_are_named(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "raises_mod.py").write_text("raise RuntimeError('no data directory')\n")
    node = Preloader(
        tmp_path / "p", PYTHONPATH=str(project), WARMSTART_PRELOAD_MODULES="no_such_module_here,raises_mod"
    ).start()
    try:
        assert node.info["skipped"] == {
            "no_such_module_here": "ModuleNotFoundError: No module named 'no_such_module_here'",
            "raises_mod": "RuntimeError: no data directory",
        }
        assert "torch" in node.info["modules"]
        out = subprocess.run(
            [PY, "-m", "warmstart", "preload", "status", "--socket", node.socket],
            env=node.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "not imported: raises_mod (RuntimeError: no data directory)" in out.stdout, out
        # Asked again with one more module: the running preloader serves, and says what it lacks.
        (project / "later_mod.py").write_text("")
        out = subprocess.run(
            [PY, "-m", "warmstart", "preload", "start", "--modules", "later_mod,raises_mod"],
            env=node.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "preloader already running" in out.stdout, out
        assert "not among the running preloader's modules: later_mod (it was started without them" in out.stdout
    finally:
        node.stop()


@pytest.mark.parametrize("foreground", [False, True])
def test_a_socket_path_that_cannot_be_used_is_refused_before_anything_is_imported(tmp_path, foreground):
    too_long = tmp_path / ("d" * 120) / "preload.sock"
    cases = {
        str(too_long): "a UNIX socket's path holds at most 107",
        "/proc/no-such-dir/preload.sock": "cannot create the preloader's directory /proc/no-such-dir",
    }
    for path, reason in cases.items():
        out = subprocess.run(
            [PY, "-m", "warmstart", "preload", "start", "--socket", path, *(["--foreground"] if foreground else [])],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and reason in lines[0], out.stderr
        assert not too_long.parent.exists()  # refused before the preloader made its directory or log


def test_a_stale_socket_or_no_preloader_is_an_ordinary_start(tmp_path):
    path = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()  # the file stays, nobody listens
    env = _clean_env(WARMSTART="1", WARMSTART_PRELOAD_SOCKET=str(path))
    for env_case in (env, {**env, "WARMSTART_PRELOAD_SOCKET": str(tmp_path / "absent.sock")}):
        out = subprocess.run(
            [PY, "-c", FORKED + "; print(_forked)"], env=env_case, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and out.stdout == "False\n", out.stderr


def test_a_stopped_or_killed_preloader_never_fails_a_program(tmp_path):
    node = Preloader(tmp_path / "p").start()
    try:
        running = subprocess.Popen(
            [PY, "-c", FORKED + "; import time; print(_forked, flush=True); time.sleep(60)"],
            env=node.client_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert running.stdout.readline() == "True\n"
        os.kill(node.info["pid"], signal.SIGSTOP)  # a busy or suspended preloader: requests wait on it
        started = time.monotonic()
        waiting = subprocess.Popen(
            [PY, "-c", FORKED + "; print(_forked)"],
            env=node.client_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        time.sleep(0.5)
        os.kill(node.info["pid"], signal.SIGKILL)  # ... and killed in the middle of that request
        assert waiting.wait(timeout=60) == 0
        assert waiting.stdout.read() == "False\n"
        assert time.monotonic() - started < 30  # a hang guard: the request is bounded (2 s)
        # The program it was running ends with it, and its process says why.
        assert running.wait(timeout=30) == 1
        assert "preloader" in running.stderr.read()
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(node.info["pid"], signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; whoever adopted it reaps it when it may


def test_a_preloader_whose_socket_is_gone_or_replaced_stops_and_removes_only_its_own(tmp_path):
    first = Preloader(tmp_path / "p").start()
    second = None
    try:
        os.unlink(first.socket)  # a cleaner of the socket's directory: nobody can reach it again
        second = Preloader(tmp_path / "p").start()  # ... and a new one at the same path
        until(lambda: not _running(first.info["pid"]), timeout=60)
        assert os.path.exists(second.socket)  # the first one's exit left the second's socket alone
        assert second.status()["pid"] == second.info["pid"]
        os.unlink(second.socket)
        until(lambda: not _running(second.info["pid"]), timeout=60)
    finally:
        for node in (first, second):
            if node is not None:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(node.info["pid"], signal.SIGKILL)


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root (to connect as another user) and a system python3 that user may run",
)
def test_another_user_is_refused():
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="ws-preload-shared-", dir="/tmp"))  # not under pytest's 0700 tmp
    directory = top / "shared"
    node = Preloader(directory).start()
    try:
        os.chmod(top, 0o755)  # let the other user reach the socket: the peer check must refuse it
        os.chmod(directory, 0o755)
        os.chmod(node.socket, 0o666)
        # The preloader reads nothing from a peer of another user: it closes the connection.
        probe = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(30); "
            f"s.connect({node.socket!r}); print(repr(s.recv(16)))"
        )
        out = subprocess.run(
            ["/usr/bin/python3", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            user=65534,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0 and out.stdout.strip() == "b''", out.stderr
        assert node.status()["refused"].get("another user") == 1
    finally:
        node.stop()
        shutil.rmtree(top, ignore_errors=True)


def test_a_forked_child_has_what_torch_loads_on_a_first_compile(preloader):
    """The compiler modules torch imports lazily, and those warmstart's store imports when it opens,
    are the preloader's, so a forked rank's first compile does not import them; a new interpreter
    has none of them."""
    from warmstart.preload.server import COMPILER_MODULES, STORE_MODULES

    code = FORKED + "; import sys; print(_forked, sorted(n for n in NAMES if n not in sys.modules))"
    code = code.replace("NAMES", repr(COMPILER_MODULES + STORE_MODULES))
    forked, plain = preloader.run(["-c", code]), preloader.run(["-c", code], preload=False)
    assert forked.returncode == plain.returncode == 0, (forked.stderr, plain.stderr)
    assert forked.stdout.strip() == "True []"
    assert plain.stdout.startswith("False ['blake3', 'cryptography.")
    assert preloader.status()["fork_safe"]


def test_a_forked_child_has_torchs_source_hash(preloader):
    """Inductor's hash of torch's sources (part of every FX graph and AOTAutograd cache key) is the
    preloader's: a forked child's first compile does not read torch's files again; a new
    interpreter does."""
    code = FORKED + textwrap.dedent("""
        from torch._inductor import codecache
        def _read_again(*args, **kwargs):
            raise SystemExit("torch's sources read again")
        codecache.build_code_hash = _read_again
        print(_forked, codecache.torch_key().hex())
    """)
    forked, plain = preloader.run(["-c", code]), preloader.run(["-c", code], preload=False)
    assert forked.returncode == 0, forked.stderr
    assert forked.stdout.split()[0] == "True" and len(forked.stdout.split()[1]) == 64
    assert (plain.returncode, plain.stderr.strip()) == (1, "torch's sources read again")


def test_a_forked_child_has_dynamos_tables_for_torchs_layers(preloader):
    """Dynamo's table of torch's overridable functions and its function names by line of torch.nn's
    layer files (it tokenizes each file it inlines from) are the preloader's; a new interpreter builds
    them at its first compile."""
    code = FORKED + textwrap.dedent("""
        import torch.nn.modules.linear as linear, torch.overrides
        from torch._dynamo import funcname_cache
        print(_forked, linear.__file__ in funcname_cache.cache,
              torch.overrides._get_overridable_functions.cache_info().currsize)
    """)
    forked, plain = preloader.run(["-c", code]), preloader.run(["-c", code], preload=False)
    assert forked.returncode == plain.returncode == 0, (forked.stderr, plain.stderr)
    assert forked.stdout.split() == ["True", "True", "1"]
    assert plain.stdout.split() == ["False", "False", "0"]


def test_the_preloader_watches_every_file_torchs_source_hash_reads():
    """A torch file the preloader never imported still decides the hash its children inherit: a
    change to one (or a file added next to it) makes the preloader refuse, as for its own modules."""
    import torch
    from torch._inductor import codecache

    from warmstart.preload.server import _hash_torch_sources

    stamps = _hash_torch_sources()
    root = Path(torch.__file__).parent
    modules = {
        path: ".".join(("torch", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for path in sorted(root.glob("*/*.py"))
    }
    never_imported = [path for path, name in modules.items() if name not in sys.modules]
    assert len(never_imported) > 10
    assert [str(path) for path in never_imported if str(path) not in stamps] == []
    assert str(root) in stamps and str(root / "_inductor") in stamps  # files added or removed
    assert str(Path(codecache.__file__).parent / "script.ld") in stamps
    assert all(stamp[0] > 0 for path, stamp in stamps.items() if path.endswith(".py"))


def test_dataloader_and_inductor_compile_workers_in_a_forked_child(preloader):
    code = FORKED + textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        data = DataLoader(TensorDataset(torch.arange(32.0)), batch_size=4, num_workers=2)
        total = sum(float(batch[0].sum()) for batch in data)
        f = torch.compile(lambda x: (x.sin() + 1).sum())
        print(_forked, total, round(float(f(torch.ones(8))), 4))
    """)
    out = preloader.run(["-c", code], timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(float(sum(range(32)))), str(round(8 * (1 + float(torch_sin_1())), 4))]


def test_two_rank_torchrun_restart_forks_both_attempts(preloader, tmp_path):
    log = tmp_path / "attempts.jsonl"
    script = tmp_path / "train.py"
    # The first attempt fails before its process group exists: torch's own restarts with gloo can
    # read the previous attempt's addresses from the agent's store (with or without a preloader).
    script.write_text(
        FORKED
        + textwrap.dedent(f"""
        import json, os, sys, time
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"rank": int(os.environ["RANK"]), "restart": restart, "forked": _forked}}) + "\\n")
        if restart == 0:
            sys.exit(1) if os.environ["RANK"] == "0" else time.sleep(60)
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    """)
    )
    out = subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            str(script),
        ],
        env=preloader.client_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((a["restart"], a["rank"]) for a in attempts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(a["forked"] for a in attempts), attempts


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def torch_sin_1() -> float:
    import math

    return math.sin(1.0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _memory_cgroup_dir() -> Path | None:
    """A new memory cgroup (v1 or v2) under this process's own, or None where one cannot be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for root, wanted in (
            ("/sys/fs/cgroup/memory", "memory"),
            ("/sys/fs/cgroup/unified", ""),
            ("/sys/fs/cgroup", ""),
        ):
            if controllers == wanted and Path(root, "cgroup.procs").exists():
                target = Path(root, path.lstrip("/"), f"ws-preload-test-{os.getpid()}")
                try:
                    target.mkdir()
                except OSError:
                    continue
                return target
    return None


def test_the_child_joins_the_processs_cgroup(preloader):
    group = _memory_cgroup_dir()
    if group is None:
        pytest.skip("no memory cgroup can be made here (needs root and a writable cgroup mount)")
    try:

        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        code = FORKED + "; print(_forked); print(open('/proc/self/cgroup').read(), end='')"
        out = subprocess.run(
            [PY, "-c", code],
            env=preloader.client_env(),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=enter,
            start_new_session=True,
        )
        assert out.returncode == 0, out.stderr
        forked, *cgroups = out.stdout.splitlines()
        assert forked == "True"
        assert any(line.endswith("/" + group.name) for line in cgroups), cgroups
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                group.rmdir()
                break
            except OSError:  # its last process is still exiting
                time.sleep(0.05)


#: What a program can see of how the kernel places and confines it.
_PLACEMENT = (
    FORKED
    + "; import json, os, socket, torch; st = dict(l.split(':', 1) for l in open('/proc/self/status'));"
    + " print(json.dumps({'forked': _forked, 'cpus': sorted(os.sched_getaffinity(0)),"
    + " 'threads': torch.get_num_threads(), 'nice': os.getpriority(os.PRIO_PROCESS, 0),"
    + " 'policy': os.sched_getscheduler(0), 'oom_score_adj': open('/proc/self/oom_score_adj').read().strip(),"
    + " 'no_new_privs': st['NoNewPrivs'].strip(), 'host': socket.gethostname(), 'groups': sorted(os.getgroups()),"
    + " 'numa': (open('/proc/self/numa_maps').readline().split() + ['', ''])[1]"
    + " if os.path.exists('/proc/self/numa_maps') else ''}))"
)


def _placed(preloader, launcher: list[str], preload: bool = True, **extra_env: str) -> dict:
    """``_PLACEMENT`` as a program started by ``launcher`` (taskset, nice...) sees it."""
    env = preloader.client_env(**extra_env)
    if not preload:
        env["WARMSTART_PRELOAD"] = "0"
    out = subprocess.run(
        [*launcher, PY, "-c", _PLACEMENT], env=env, capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _launchers(*names: str) -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux)")


def test_the_child_takes_on_the_processs_cpus_priority_and_oom_score(preloader):
    _launchers("taskset", "nice", "chrt", "ionice", "setpriv")
    one_cpu = str(min(os.sched_getaffinity(0)))
    # A launcher of its own, without site (-S: no start-up hook, so it is no program handed over itself)
    oom = [
        sys.executable,
        "-S",
        "-c",
        "import os, sys; open('/proc/self/oom_score_adj', 'w').write('500'); os.execv(sys.argv[1], sys.argv[1:])",
    ]
    for launcher, extra in (
        (["taskset", "-c", one_cpu], {"OMP_NUM_THREADS": "1"}),  # how many threads: torchrun sets it
        (["nice", "-n", "5"], {}),
        (["chrt", "--batch", "0"], {}),
        (["setpriv", "--no-new-privs"], {}),
        (oom, {}),
    ):
        forked = _placed(preloader, launcher, **extra)
        fresh = _placed(preloader, launcher, preload=False, **extra)
        assert forked.pop("forked") and not fresh.pop("forked")
        assert forked == fresh, launcher
    # the I/O priority, seen from outside the program
    code = (
        FORKED
        + "; import os, subprocess; ionice = ['ionice', '-p', str(os.getpid())]"
        + "; print(_forked, subprocess.run(ionice, capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run(
        ["ionice", "-c", "3", PY, "-c", code],
        env=preloader.client_env(),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.stdout == "True idle\n", out.stderr


def test_a_process_in_another_namespace_or_with_other_groups_starts_as_usual(preloader):
    _launchers("taskset", "unshare", "setpriv")
    for probe in (["unshare", "--uts", "true"], ["setpriv", "--groups", "4321", "true"]):
        if subprocess.run(probe, capture_output=True, timeout=60).returncode != 0:
            pytest.skip(f"{' '.join(probe)} is not permitted here (needs root, or CAP_SYS_ADMIN and CAP_SETGID)")
    before = preloader.status()["refused"]
    # A container's or unshare's process must not run in the preloader's namespaces.
    renamed = ["unshare", "--uts", "sh", "-c", 'hostname warmstart-test && exec "$@"', "sh"]
    seen = _placed(preloader, renamed)
    assert not seen["forked"] and seen["host"] == "warmstart-test"
    seen = _placed(preloader, ["setpriv", "--groups", "4321"])
    assert not seen["forked"] and seen["groups"] == [4321]
    verdict = "from warmstart.preload.control import would_hand_over; print(would_hand_over())"
    out = subprocess.run(
        ["unshare", "--uts", PY, "-c", verdict],
        env=preloader.client_env(),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.stdout.startswith("(False,") and "another UTS namespace" in out.stdout, out.stderr
    # Other CPUs with nothing saying how many threads torch runs: torch would count them itself.
    one_cpu = str(min(os.sched_getaffinity(0)))
    env = {k: "" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    seen = _placed(preloader, ["taskset", "-c", one_cpu], **env)
    fresh = _placed(preloader, ["taskset", "-c", one_cpu], preload=False, **env)
    assert not seen["forked"] and seen["threads"] == fresh["threads"]
    refused = preloader.status()["refused"]
    assert refused.get("the process runs with another UTS namespace", 0) > before.get(
        "the process runs with another UTS namespace", 0
    )
    assert refused.get("the process runs with other supplementary groups", 0) > before.get(
        "the process runs with other supplementary groups", 0
    )


def test_a_preloader_with_no_new_privileges_serves_only_processes_that_have_it(tmp_path):
    _launchers("setpriv")
    directory = tmp_path / "p"
    directory.mkdir(mode=0o700)
    node = Preloader(directory)
    # Started as a sandboxing service manager would start it (NoNewPrivileges=yes)
    out = subprocess.run(
        ["setpriv", "--no-new-privs", PY, "-m", "warmstart", "preload", "start", "--json"],
        env=node.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    try:
        # A child could not drop the flag: a process without it (setuid programs elevate) starts as usual.
        seen = _placed(node, [])
        assert not seen["forked"] and seen["no_new_privs"] == "0"
        seen = _placed(node, ["setpriv", "--no-new-privs"])
        assert seen["forked"] and seen["no_new_privs"] == "1"
        assert node.status()["refused"] == {"the process runs with no-new-privileges off": 1}
    finally:
        node.stop()


_WITH_MEMORY_POLICY = """
import ctypes, os, platform, sys
number = {"x86_64": 238, "aarch64": 237}[platform.machine()]  # set_mempolicy
node0 = ctypes.c_ulong(1)
if ctypes.CDLL(None, use_errno=True).syscall(number, 1, ctypes.byref(node0), 64) != 0:  # MPOL_PREFERRED
    sys.exit(f"set_mempolicy: {os.strerror(ctypes.get_errno())}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_a_process_with_a_numa_memory_policy_starts_as_usual(preloader):
    if not os.path.exists("/proc/self/numa_maps") or os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("a kernel with NUMA memory policies, on x86_64 or aarch64")
    seen = _placed(preloader, [sys.executable, "-S", "-c", _WITH_MEMORY_POLICY])  # -S: no start-up hook
    assert not seen["forked"] and seen["numa"].startswith("prefer"), seen


def test_doctor_says_whether_a_process_would_be_handed_over(preloader):
    def doctor(**extra: str) -> str:
        out = subprocess.run(
            [PY, "-m", "warmstart", "cache", "doctor"],
            env=preloader.client_env(**extra),
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        lines = out.stdout.splitlines()
        first = next(i for i, line in enumerate(lines) if "preloader:" in line)
        check = [lines[first]]
        for line in lines[first + 1 :]:  # the check's lines wrapped to the width, indented under its text
            if not line.startswith("      "):
                break
            check.append(line.strip())
        return " ".join(check)

    assert f"handed over: the preloader at {preloader.socket}" in doctor()
    line = doctor(TORCHINDUCTOR_MAX_AUTOTUNE="1")
    assert "not handed over" in line and "TORCHINDUCTOR_MAX_AUTOTUNE" in line
    assert "not handed over: WARMSTART_PRELOAD=0" in doctor(WARMSTART_PRELOAD="0")
