"""A forked child of the preloader becoming the program a process handed over.

The child, not the preloader, reads what the process sends of itself (its command line, environment
and descriptors): the preloader never holds one program's data in memory that it would pass on to
the next. First everything that can fail or refuse (what the preloader's imports read that differs
in this process, a module of the program's own directory that would shadow a preloaded one, its
own session, the process's cgroup, resource limits, descriptors, working directory, environment,
signal dispositions); a failure there is reported to the process, which then starts as usual. Then,
once the process knows the child runs its program, the interpreter state a fresh interpreter would
have had (``sys.argv``, ``sys.path[0]``, a new ``__main__``, standard streams on the process's
descriptors, fresh random seeds, warmstart's settings from the process's environment), and the
program, run as ``python`` runs it, and the end of the interpreter in what the program can observe
(see :mod:`warmstart.preload.shutdown`).
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
from typing import Any, NoReturn

from warmstart.preload import kernel_state, recording, shutdown, wire
from warmstart.preload.client import HANDOVER_TIMEOUT_S, program_mode
from warmstart.preload.handoff import CHILD_DECLINED, DRY_RUN, Request
from warmstart.preload.kernel_state import read_proc

_PR_SET_PDEATHSIG = 1

_Program = tuple[str, str, list[str]]  # program_mode's (mode, target, args)


def become(request: Request) -> NoReturn:
    """Read the rest of ``request``'s process, set up this child as it would have started, run its
    program and end as the interpreter ends one (never returns)."""
    conn = request.conn
    message: dict = {}
    try:
        conn.settimeout(HANDOVER_TIMEOUT_S)
        message, fds = wire.receive(conn)  # the process's data: read here, never in the preloader
        mode = program_mode(message["argv"])
        if mode is None:  # a client hands over only what it can run: this request came from elsewhere
            raise ValueError("the command line is not one a preloader runs")
        _check_imports(message, mode)
        conn = _setup(message, conn, fds)
        if message.get("dry_run"):  # `cache doctor` asking whether such a process would be run
            wire.send(conn, {"would_run": True})
            os.write(request.reason_fd, DRY_RUN)
            os._exit(CHILD_DECLINED)
        pidfd = os.pidfd_open(os.getpid())
    except Exception as exc:  # anything: the process then starts as usual
        reason = str(exc) if isinstance(exc, Declined) else f"the child could not be set up ({_named(exc)})"
        with contextlib.suppress(OSError):
            wire.send(conn, {"declined": reason})
        with contextlib.suppress(OSError):
            os.write(request.reason_fd, DRY_RUN if message.get("dry_run") else reason.encode()[:4000])
        os._exit(CHILD_DECLINED)
    wire.send(conn, {"running": os.getpid()}, [pidfd])
    os.close(pidfd)
    conn.close()  # the preloader passes the program's end on: nothing of the handover stays open in it
    os.close(request.reason_fd)
    shutdown.report_to(request.preloader_socket)
    _interpreter_state(message, mode)
    _run_program(mode)


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Declined(Exception):
    """This process cannot be run as a new interpreter would run it: it starts as usual."""


def _check_imports(message: dict, program: _Program) -> None:
    """Refuse what would make the preloaded imports differ from the program's own: a variable they
    read with another value here, a module in the program's first ``sys.path`` entry that a new
    interpreter would import in place of a preloaded one, the working directory kept where it cannot
    be replaced."""
    from warmstart.preload import environment

    reads = IMPORT_READS
    if reads is None:
        return
    theirs = message["environ"]
    for name, value in sorted(reads.environ.items()):
        if environment.applied_in_child(name):
            continue
        if theirs.get(name) != value:
            state = "unset" if name not in theirs else "set" if value is None else "another value"
            raise Declined(f"{name} is {state} here; the preloaded modules read it when they were imported")
    first = _first_path_entry(program, message["cwd"])
    if first is not None:
        shadowing = sorted(_module_names(first) & SHADOWABLE)
        if shadowing:
            raise Declined(
                f"{os.path.join(first, shadowing[0])} would be imported in place of the preloaded "
                f"{shadowing[0]} (or of a module the preloaded ones looked for) in a new interpreter"
            )
    kept = WORKING_DIRECTORY_STRINGS.fixed if WORKING_DIRECTORY_STRINGS is not None else []
    if kept:
        raise Declined(f"the preloaded modules keep the directory they were imported in, in {kept[0]}")


def _first_path_entry(program: _Program, cwd: str) -> str | None:
    """The directory the interpreter puts first on ``sys.path`` for ``program``, or ``None`` (-P)."""
    if getattr(sys.flags, "safe_path", False):  # -P, from 3.11
        return None
    mode, target, _ = program
    if mode == "script":
        return _script_path_entry(os.path.join(cwd, target))
    return cwd


def _module_names(entry: str) -> set[str]:
    """The top-level names a ``sys.path`` entry offers: a directory's modules and packages, or those
    at the top of a zip file (a zipapp)."""
    from warmstart.preload.watch import importable_entries

    if os.path.isdir(entry):
        return {name.partition(".")[0] for name in importable_entries(entry)}
    if not _is_zip(entry):
        return set()
    import zipfile

    with zipfile.ZipFile(entry) as archive:
        tops = {name.split("/", 1)[0] for name in archive.namelist()}
    return {name.partition(".")[0] for name in tops if name.partition(".")[0].isidentifier()}


#: What the preloader's imports read (:mod:`warmstart.preload.recording`), and the top-level names a
#: module in the program's own directory must not have: the modules they imported (less those the
#: interpreter had imported before, at start-up) and those they looked for in vain. Set by
#: :func:`note_imports`.
IMPORT_READS: recording.ImportReads | None = None
SHADOWABLE: frozenset[str] = frozenset()
WORKING_DIRECTORY_STRINGS: recording.Strings | None = None


def note_imports(reads: recording.ImportReads, before: set[str]) -> None:
    """Note what the preloader's imports read, which top-level modules they brought (``before``: the
    modules imported before them), and where they kept the working directory they ran in."""
    global IMPORT_READS, SHADOWABLE, WORKING_DIRECTORY_STRINGS
    IMPORT_READS = reads
    found = recording.working_directory_strings(reads.cwd)
    # the record itself holds the directory: not something a program would see
    found.places = [(holder, key) for holder, key in found.places if holder is not vars(reads)]
    WORKING_DIRECTORY_STRINGS = found
    imported = {name.partition(".")[0] for name in sys.modules} - {name.partition(".")[0] for name in before}
    SHADOWABLE = frozenset(imported | set(reads.missing))


def _setup(message: dict, conn: socket.socket, fds: list[int]) -> socket.socket:
    os.setsid()  # its own process group: what it starts ends with it, and the preloader's signals are not its
    _die_with_parent()
    _join_cgroup(message.get("cgroup", ""))
    conn = _place_fds(message["fds"], conn, fds)
    os.chdir(message["cwd"])
    os.umask(message["umask"])
    _check_stack_limit(message.get("rlimits", {}))
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
    mine = read_proc("/proc/self/cgroup")
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
    for line in read_proc("/proc/self/mountinfo").splitlines():
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


def _place_fds(numbers: list[int], conn: socket.socket, received: list[int]) -> socket.socket:
    """Put the process's descriptors at their numbers; returns the connection, moved out of their way."""
    if len(received) != len(numbers):
        raise RuntimeError(f"{len(received)} descriptors came, {len(numbers)} were sent")
    base = max([*numbers, 2]) + 1
    accepted = conn.detach()
    conn_fd = fcntl.fcntl(accepted, fcntl.F_DUPFD_CLOEXEC, base)
    os.close(accepted)
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


def _check_stack_limit(rlimits: dict) -> None:
    # The C library sizes new threads' stacks from the stack limit once, when the process starts:
    # a child that took on another limit would still give its threads the preloader's size.
    import resource

    theirs = rlimits.get(resource.RLIMIT_STACK)
    if theirs is not None and theirs[0] != resource.getrlimit(resource.RLIMIT_STACK)[0]:
        raise Declined("its stack size limit differs from the preloader's (threads' stacks are sized from it at start)")


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
    _rebase_working_directory()
    _own_identity()
    _launch.forked_at(message.get("start_ts"))
    from warmstart.compile_cache import torch_hooks

    torch_hooks.forget_preloader_settings()
    _bootstrap.start(hand_over=False)  # warmstart's settings, from the process's environment


def _standard_streams(unbuffered: bool) -> None:
    # As the interpreter makes them at start (create_stdio): text over io.open(fd) (binary, unbuffered
    # for writing under -u), newline "\n" (no translation of "\r"), line-buffered on a terminal or for
    # stderr, the encoding from the (same) locale and PYTHONIOENCODING; None where the descriptor is
    # closed.
    encoding = os.environ.get("PYTHONIOENCODING", "").partition(":")[0] or None
    errors = os.environ.get("PYTHONIOENCODING", "").partition(":")[2] or None

    def stream(fd: int, mode: str):
        if not _is_open(fd):
            return None
        write = mode == "w"
        buffering = 0 if unbuffered and write else -1
        binary: Any = open(fd, mode + "b", buffering, closefd=False)  # noqa: SIM115 (the program's sys.std*)
        raw = binary if buffering == 0 else binary.raw
        raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]  # as the interpreter names them
        text = io.TextIOWrapper(
            binary,
            encoding=encoding or (sys.stdout or sys.__stdout__ or io.StringIO()).encoding,
            errors=("backslashreplace" if fd == 2 else errors or _stdio_errors()),
            newline="\n",
            line_buffering=not unbuffered and (raw.isatty() or fd == 2),
            write_through=unbuffered,
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
    # (joined to the working directory, not normalised); a script's directory, every link on the
    # way resolved (the interpreter's realpath of the script).
    if _is_package_main(script):
        return os.path.join(os.getcwd(), script)
    return os.path.dirname(os.path.realpath(script))


def _is_package_main(script: str) -> bool:
    return os.path.isdir(script) or (not script.endswith((".py", ".pyw")) and _is_zip(script))


def _thread_count(preloader_environ: dict[str, str], moved: bool) -> None:
    # torch fixed its intra-op thread count when the preloader imported it: from MKL_NUM_THREADS, else
    # OMP_NUM_THREADS (MKL's count wins where torch uses MKL), else from the CPUs it may run on. The
    # program's count where its variables differ; refused where it cannot be told.
    torch = sys.modules.get("torch")
    if torch is None:
        return
    names = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
    theirs = tuple(os.environ.get(name) or None for name in names)
    if theirs == tuple(preloader_environ.get(name) or None for name in names):
        if moved and theirs == (None, None):
            raise Declined("the process runs on other CPUs and no OMP_NUM_THREADS says how many threads torch uses")
        return
    mkl = bool(getattr(torch.backends, "mkl", None) and torch.backends.mkl.is_available())
    value = (theirs[0] if mkl else None) or theirs[1]
    if value is None or not value.isdigit() or int(value) < 1:
        raise Declined(
            f"torch's thread count cannot be set from MKL_NUM_THREADS={theirs[0]} OMP_NUM_THREADS={theirs[1]} "
            f"(the preloader's are {preloader_environ.get(names[0])} and {preloader_environ.get(names[1])})"
        )
    torch.set_num_threads(int(value))


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
    for ref in IMPORT_READS.entropy_seeded if IMPORT_READS is not None else ():
        generator = ref()  # sympy's, and any other a preloaded module seeded from the OS's entropy
        if generator is not None:
            with contextlib.suppress(Exception):
                generator.seed()
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None:
            if _TORCH_GENERATOR_AFTER_IMPORTS is not None:
                torch.default_generator.set_state(_TORCH_GENERATOR_AFTER_IMPORTS)
            else:
                torch.default_generator.seed()


def _rebase_working_directory() -> None:
    # What the preloaded modules made of the working directory they were imported in, made of the
    # program's, as its own imports would have.
    if IMPORT_READS is not None and WORKING_DIRECTORY_STRINGS is not None:
        recording.replace_strings(WORKING_DIRECTORY_STRINGS, IMPORT_READS.cwd, os.getcwd())


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


def _run_program(mode: _Program) -> NoReturn:
    """Run the program and end as the interpreter would (:mod:`warmstart.preload.shutdown`)."""
    try:
        _run(mode)
        outcome: BaseException | None = None
    except BaseException as exc:
        outcome = exc
    status = shutdown.outcome_status(outcome, _program_traceback(outcome))
    del outcome
    shutdown.end(status)


def _program_traceback(exc: BaseException | None):
    # The traceback a plain run prints starts at the program's frames, not at this module's.
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)
