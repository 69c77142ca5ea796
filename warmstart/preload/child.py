"""A forked child of the preloader becoming the program a process handed over.

First everything that can fail (its own session, the process's cgroup, resource limits, descriptors,
working directory, environment, signal dispositions); a failure there is reported to the process,
which then starts as usual. Then, once the process knows the child runs its program, the interpreter
state a fresh interpreter would have had (``sys.argv``, ``sys.path[0]``, a new ``__main__``,
standard streams on the process's descriptors, fresh random seeds, warmstart's settings from the
process's environment), and the program, run as ``python`` runs it.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import importlib.machinery
import io
import os
import signal
import socket
import sys
import types
from typing import Any

from warmstart.preload import kernel_state, wire
from warmstart.preload.client import _read, program_mode
from warmstart.preload.server import CHILD_DECLINED, Request

_PR_SET_PDEATHSIG = 1

_Program = tuple[str, str, list[str]]  # program_mode's (mode, target, args)


def become(request: Request) -> None:
    """Set up this child as ``request``'s process would have started, run its program and end as
    the interpreter would (never returns).

    It ends as ``multiprocessing``'s forked children do: after the program's threads, its atexit
    handlers and a flush of every open file, without tearing the interpreter down module by module,
    which for a process that imported torch and TorchRec takes over a second and changes nothing
    the program could see."""
    message = request.message
    conn = request.conn
    try:
        mode = program_mode(message["argv"])
        if mode is None:  # a client hands over only what it can run: this request came from elsewhere
            raise ValueError("the command line is not one a preloader runs")
        conn = _setup(message, request)
        pidfd = os.pidfd_open(os.getpid())
    except Exception as exc:  # anything: the process then starts as usual
        with contextlib.suppress(OSError):
            wire.send(conn, {"declined": f"the child could not be set up ({type(exc).__name__}: {exc})"})
        os._exit(CHILD_DECLINED)
    wire.send(conn, {"running": os.getpid()}, [pidfd])
    os.close(pidfd)
    _interpreter_state(message, mode)
    _end(_run_program(mode), conn)


def _setup(message: dict, request: Request) -> socket.socket:
    os.setsid()  # its own process group: what it starts ends with it, and the preloader's signals are not its
    _die_with_parent()
    _join_cgroup(message.get("cgroup", ""))
    conn = _place_fds(message["fds"], request)
    os.chdir(message["cwd"])
    os.umask(message["umask"])
    for resource_id, (soft, hard) in message.get("rlimits", {}).items():
        _set_rlimit(resource_id, soft, hard)
    # After the limits: RLIMIT_NICE and RLIMIT_RTPRIO are what permit a priority without privilege.
    moved = kernel_state.take_on(message.get("placement", {}), message.get("isolation", {}), int(message["pid"]))
    preloader_environ = dict(os.environ)
    os.environ.clear()
    os.environ.update(message["environ"])
    _thread_count(preloader_environ, moved)
    ignored = set(message.get("ignored", ()))
    for signum in range(1, signal.NSIG):
        with contextlib.suppress(OSError, ValueError):
            if signum in ignored:
                signal.signal(signum, signal.SIG_IGN)
            elif signum == signal.SIGINT:
                signal.signal(signum, signal.default_int_handler)
            elif signal.getsignal(signum) not in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, message.get("blocked", ()))
    return conn


def _die_with_parent() -> None:
    # A child of a preloader that is killed must not run on with nobody to report its end.
    kernel_state.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        raise RuntimeError("the preloader ended during the fork")


def _join_cgroup(theirs: str) -> None:
    """Move this child into the process's cgroups where they differ from the preloader's: a job's
    memory limits and its scheduler's cleanup must hold for its program. Raises when not allowed."""
    mine = _read("/proc/self/cgroup")
    if not theirs or theirs == mine:
        return
    roots = _cgroup_roots()
    mine_by_id = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in mine.splitlines() if line.count(":") >= 2}
    for line in theirs.splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if mine_by_id.get(controllers) == path:
            continue
        mount = roots.get(controllers)
        if mount is None or not (path + "/").startswith(mount[1].rstrip("/") + "/"):
            raise RuntimeError(f"the process's cgroup {controllers or 'v2'}:{path} is not mounted here")
        point, root = mount
        target = os.path.join(point, path[len(root.rstrip("/")) :].lstrip("/"), "cgroup.procs")
        with open(target, "w") as f:
            f.write(str(os.getpid()))


def _cgroup_roots() -> dict[str, tuple[str, str]]:
    """Hierarchy (its controllers, ``""`` for v2) -> (mount point, the hierarchy's path mounted there)."""
    roots = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            roots[""] = (fields[4], fields[3])
        elif tail[0] == "cgroup":
            options = tail[2].split(",")
            named = [o for o in options if o.startswith("name=")]
            controllers = (
                ",".join(named)
                if named
                else ",".join(
                    o
                    for o in options
                    if o not in ("rw", "ro", "nosuid", "nodev", "noexec", "relatime", "clone_children")
                )
            )
            roots[controllers] = (fields[4], fields[3])
    return roots


def _place_fds(numbers: list[int], request: Request) -> socket.socket:
    """Put the process's descriptors at their numbers; returns the connection, moved out of their way."""
    received = request.fds
    if len(received) != len(numbers):
        raise RuntimeError(f"{len(received)} descriptors came, {len(numbers)} were sent")
    base = max([*numbers, 2]) + 1
    conn_fd = fcntl.fcntl(request.conn.detach(), fcntl.F_DUPFD_CLOEXEC, base)
    held = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in received]
    kept = {conn_fd, *held}
    for fd in received:
        os.close(fd)
    for fd in (0, 1, 2):  # the preloader's own streams, when the process had none there
        if fd not in numbers:
            with contextlib.suppress(OSError):
                os.close(fd)
    busy = [n for n in numbers if n > 2 and _is_open(n) and n not in kept]
    if busy:
        raise RuntimeError(f"descriptor {busy[0]} is in use in the preloader")
    for fd, number in zip(held, numbers, strict=True):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    return socket.socket(fileno=conn_fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _set_rlimit(resource_id: int, soft: int, hard: int) -> None:
    import resource

    if resource.getrlimit(resource_id) != (soft, hard):
        resource.setrlimit(resource_id, (soft, hard))


def _interpreter_state(message: dict, program: _Program) -> None:
    from warmstart import _bootstrap, _launch

    argv = message["argv"]
    mode, target, args = program
    sys.orig_argv = list(argv)
    sys.argv = {"script": [target], "module": [target], "command": ["-c"]}[mode] + list(args)
    _standard_streams(unbuffered=_unbuffered(argv))
    # As the interpreter makes __main__: the builtins module (not its dict), empty annotations, and
    # BuiltinImporter as loader until the program's own (a script's, below; runpy's for -m).
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={}, __loader__=importlib.machinery.BuiltinImporter)
    sys.modules["__main__"] = main
    safe_path = sys.version_info >= (3, 11) and sys.flags.safe_path  # -P came with 3.11
    if not safe_path:
        first = {"script": _script_path_entry(target), "module": os.getcwd(), "command": ""}[mode]
        sys.path.insert(0, first)
    _reseed()
    _own_identity()
    _launch.forked_at(message.get("start_ts"))
    from warmstart.compile_cache import torch_hooks

    torch_hooks.forget_preloader_settings()
    _bootstrap.start(hand_over=False)  # warmstart's settings, from the process's environment


def _standard_streams(unbuffered: bool) -> None:
    # As the interpreter makes them at start: text over the descriptor, line-buffered on a terminal,
    # the encoding from the (same) locale and PYTHONIOENCODING; None where the descriptor is closed.
    encoding = os.environ.get("PYTHONIOENCODING", "").partition(":")[0] or None
    errors = os.environ.get("PYTHONIOENCODING", "").partition(":")[2] or None

    def stream(fd: int, mode: str):
        if not _is_open(fd):
            return None
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]  # as the interpreter names them
        tty = raw.isatty()
        buffered = (io.BufferedWriter if "w" in mode else io.BufferedReader)(raw)
        text = io.TextIOWrapper(
            buffered,
            encoding=encoding or (sys.stdout or sys.__stdout__ or io.StringIO()).encoding,
            errors=("backslashreplace" if fd == 2 else errors or _stdio_errors()),
            line_buffering=(tty or fd == 2) and not unbuffered,
            write_through=unbuffered or fd == 2,
        )
        text.mode = mode  # type: ignore[misc]
        return text

    # The originals too: in the program's process they are these streams, not the preloader's.
    sys.stdin = sys.__stdin__ = stream(0, "r")  # type: ignore[misc]  # typeshed makes them Final
    sys.stdout = sys.__stdout__ = stream(1, "w")  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = stream(2, "w")  # type: ignore[misc]


def _stdio_errors() -> str:
    # What the interpreter gives stdin and stdout when PYTHONIOENCODING names none: surrogateescape
    # in UTF-8 mode and in the C and POSIX locales (and the UTF-8 ones it coerces those to).
    import locale

    if sys.flags.utf8_mode or locale.setlocale(locale.LC_CTYPE) in ("C", "POSIX", "C.UTF-8", "C.utf8", "UTF-8"):
        return "surrogateescape"
    return "strict"


def _unbuffered(argv: list[str]) -> bool:
    if os.environ.get("PYTHONUNBUFFERED"):
        return True
    for arg in argv[1:]:
        if not arg.startswith("-") or arg in ("-c", "-m"):
            return False
        if arg.startswith("-") and not arg.startswith("--") and "u" in arg[1:].split("c")[0].split("m")[0]:
            return True
    return False


def _script_path_entry(script: str) -> str:
    # As the interpreter computes it: a directory or zip file with a __main__.py is itself the entry
    # (joined to the working directory, not normalised); a script's directory, its links resolved.
    if _is_package_main(script):
        return os.path.join(os.getcwd(), script)
    return os.path.dirname(os.path.abspath(os.path.realpath(script) if os.path.islink(script) else script))


def _is_package_main(script: str) -> bool:
    return os.path.isdir(script) or (not script.endswith((".py", ".pyw")) and _is_zip(script))


def _thread_count(preloader_environ: dict[str, str], moved: bool) -> None:
    # torch fixed its intra-op thread count from OMP_NUM_THREADS / MKL_NUM_THREADS when the
    # preloader imported it: the program's value, when it has another.
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if moved and not any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        # Without them, torch counts its threads from the CPUs it may run on (through MKL or OpenMP,
        # once per process), which it did for the preloader's CPUs.
        raise RuntimeError("the process runs on other CPUs and no OMP_NUM_THREADS says how many threads torch uses")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(name)
        if value != preloader_environ.get(name):
            with contextlib.suppress(ValueError, RuntimeError):
                if value and int(value) > 0:
                    torch.set_num_threads(int(value))
            return


#: torch's default CPU generator as the preloader's imports left it, when one of them seeded it
#: (:func:`note_generators`); ``None`` when it still has the seed torch drew for the preloader.
_TORCH_GENERATOR_AFTER_IMPORTS: Any = None


def note_generators(seed_at_torch_import: int | None) -> None:
    """Note whether the preloader's imports seeded torch's CPU generator (``torch.manual_seed`` at a
    module's top level) and, if so, its state after them: what a new interpreter importing the same
    modules would draw from next. The preloader calls it once, after its imports, with the seed the
    generator had right after ``import torch``."""
    global _TORCH_GENERATOR_AFTER_IMPORTS
    torch = sys.modules.get("torch")
    if torch is not None and seed_at_torch_import is not None and torch.initial_seed() != seed_at_torch_import:
        _TORCH_GENERATOR_AFTER_IMPORTS = torch.default_generator.get_state()


def _reseed() -> None:
    # As in a new interpreter: random re-seeds itself after a fork; numpy's global generator does
    # not. torch seeds its CPU generator from the OS's entropy when it is created, so every child
    # gets a new seed, unless the imports seeded it: then the state they left. Set on the generator
    # itself: torch.manual_seed() and torch.seed() also seed the CUDA and XPU generators, which in a
    # new interpreter start from torch's fixed default seed.
    numpy = sys.modules.get("numpy")
    with contextlib.suppress(Exception):
        if numpy is not None:
            numpy.random.seed()
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None:
            if _TORCH_GENERATOR_AFTER_IMPORTS is not None:
                torch.default_generator.set_state(_TORCH_GENERATOR_AFTER_IMPORTS)
            else:
                torch.default_generator.seed()


def _own_identity() -> None:
    # What a new interpreter has of its own and the fork copied from the preloader: multiprocessing's
    # authentication key (one program's Manager or Listener must not take another's connections)
    # and the main thread's native id (threading updates its ident after a fork, not this).
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)
    threading = sys.modules.get("threading")
    if threading is not None:
        with contextlib.suppress(AttributeError):
            threading.main_thread()._set_native_id()


def _run(mode: _Program) -> None:
    kind, target, _args = mode
    main = sys.modules["__main__"]
    if kind == "module":
        import runpy

        # Private, but what the interpreter itself runs for -m: the code runs in the real __main__.
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        return
    if kind == "command":
        _exec(compile(target, "<string>", "exec"), main)
        return
    if _is_package_main(target):
        import runpy

        # A directory or zip with __main__.py: private, as above.
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    with open(target, "rb") as f:
        source = f.read()
    path = os.path.abspath(target)  # as the interpreter names a script it runs
    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=importlib.machinery.SourceFileLoader("__main__", path)
    )
    _exec(compile(source, path, "exec"), main)


def _exec(code, main: types.ModuleType) -> None:
    exec(code, main.__dict__)


_SIGINT_EXIT = -int(signal.SIGINT)  # _run_program: end by SIGINT, as an uncaught KeyboardInterrupt does


def _run_program(mode: _Program) -> int:
    """Run the program; its exit status, as the interpreter's top level would make it."""
    try:
        _run(mode)
        return 0
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException as exc:
        trimmed = _program_traceback(exc.__traceback__)
        exc.__traceback__ = trimmed  # the hook prints the exception's own traceback, whatever it is given
        sys.excepthook(type(exc), exc, trimmed)
        return _SIGINT_EXIT if isinstance(exc, KeyboardInterrupt) else 1


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _program_traceback(tb):
    # The traceback a plain run prints starts at the program's frames, not at this module's.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _end(status: int, conn: socket.socket) -> None:
    import atexit
    import gc
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # the program's non-daemon threads
    atexit._run_exitfuncs()
    # What module teardown would have flushed: files the program left open.
    writable = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
    for obj in gc.get_objects():
        if issubclass(type(obj), writable):  # type(), not isinstance: no object's __class__ runs
            with contextlib.suppress(BaseException):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    # The process learns the status from here rather than from the preloader once the kernel has
    # torn this address space down (tens of milliseconds for one that imported torch).
    with contextlib.suppress(OSError):
        wire.send(conn, {"signal": int(signal.SIGINT)} if status == _SIGINT_EXIT else {"exit": status})
    if status == _SIGINT_EXIT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)
