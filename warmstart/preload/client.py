"""Handing this process over to a preloader: the start-up hook's first step where ``WARMSTART=1``.

When a preloader serves this user, interpreter and import-time environment, this process sends it
everything a fresh interpreter would start from (its command line, working directory, environment,
umask, resource limits, signal dispositions and open file descriptors) and the preloader forks a
child that runs the program with torch and the compiler already imported. This process stays, with
its pid: it forwards every signal it gets to the child and ends as the child ends (its exit status,
or the same signal). If it is killed outright, the preloader kills the child.

Anything that does not fit (no preloader, another environment, a busy or dead preloader, a program
that is read from the terminal) leaves this process to start as usual. Built-in modules only, and
nothing at all when no preloader listens: every ``WARMSTART=1`` interpreter runs it.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: this runs at every interpreter start, before anything is imported
if TYPE_CHECKING:
    from collections.abc import Mapping

#: How long a preloader may take to answer a request (fork and set up the child) before this
#: process gives up on it and starts as usual.
HANDOVER_TIMEOUT_S = 2.0

_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_NOT_FORWARDED = ("SIGCHLD", "SIGTTIN", "SIGTTOU")  # about this process itself, not the program


def handover_allowed(environ: Mapping[str, str]) -> bool:
    """Whether ``WARMSTART_PRELOAD`` lets a process be handed over: unset or ``1``. Not for ``0``, nor
    for a value that is not valid (the settings say so, in one line)."""
    return environ.get("WARMSTART_PRELOAD", "") in ("", "1")


def handover() -> None:
    """Run this program in a child of the preloader and exit as it does; return (and start as usual)
    when no preloader takes it."""
    if not handover_allowed(os.environ) or os.environ.get("WARMSTART_PRELOAD_SERVE"):
        return
    from warmstart.preload.environment import default_socket

    path = default_socket()
    try:
        os.stat(path)
    except OSError:
        return  # the common case, and the cheap one: no preloader here
    reason = _handover(path)
    if reason is not None:
        _info(f"warmstart: started without the preloader ({reason})")


def program_mode(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``(mode, target, args)`` of an interpreter command line (``sys.orig_argv``): ``("script",
    path, args)``, ``("module", name, args)`` or ``("command", code, args)``; ``None`` for what a
    preloader does not run (the interactive prompt, a program read from stdin, ``-i``).

    Interpreter options before the program are accepted when they are ones the preloader's own
    interpreter has too (its flags are compared separately) or ``-u``.
    """
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "-m"):
            return _program_after(arg[1], argv, i + 1)
        if arg in ("-", "-i") or arg.startswith("--") and arg not in ("--check-hash-based-pycs",):
            return None
        if arg.startswith("-") and len(arg) > 1:
            after = _option_cluster(argv, i)
            if not isinstance(after, int):
                return after
            i = after
            continue
        return ("script", arg, argv[i + 1 :])
    return None


_MODES = {"c": "command", "m": "module"}


def _program_after(letter: str, argv: list[str], i: int) -> tuple[str, str, list[str]] | None:
    """The program of ``-c``/``-m`` (``letter``) whose code or module is ``argv[i]``; ``None`` when the
    command line ends before it."""
    return (_MODES[letter], argv[i], argv[i + 1 :]) if i < len(argv) else None


def _option_cluster(argv: list[str], i: int) -> tuple[str, str, list[str]] | int | None:
    """One argument of one-letter options at ``argv[i]`` (``-u``, ``-Bu``, ``-W error``, ``-uc CODE``):
    the program it starts, ``None`` where it is one a preloader does not run (``-i``), else the index
    of the argument after it and its value."""
    arg = argv[i]
    letters = arg[1:]
    for j, letter in enumerate(letters):
        rest = letters[j + 1 :]
        if letter in _MODES:  # -uc CODE, -um MOD
            return (_MODES[letter], rest, argv[i + 1 :]) if rest else _program_after(letter, argv, i + 1)
        if letter in "WX-":  # -W arg, -X opt: the value is the rest or the next argument
            if not rest:
                i += 1
            break
        if letter == "i":
            return None
    if arg == "--check-hash-based-pycs":
        i += 1
    return i + 1


def _unrunnable_script(path: str) -> str | None:
    """Why a script is left to the interpreter itself: one it cannot open (its own message and exit
    status 2), or compiled bytecode (which it runs as such)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except IsADirectoryError:
        return None  # a directory with a __main__.py
    except OSError:
        return "the script cannot be opened"
    import _frozen_importlib_external  # the interpreter's own, loaded already

    if path.endswith(".pyc") or head[:2] == _frozen_importlib_external.MAGIC_NUMBER[:2]:
        return "the script is compiled bytecode"
    return None


def has_controlling_terminal() -> bool:
    """Whether this process has a controlling terminal (a command typed at a shell). A forked child
    runs in a session of its own and could not open ``/dev/tty``: ``getpass`` would read a password
    from stdin and echo it. torchrun, Slurm and Kubernetes start ranks without one."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _handover(path: str) -> str | None:
    import _signal
    import _socket

    argv = list(getattr(sys, "orig_argv", ()) or ())
    mode = program_mode(argv)
    if mode is None:
        return "the program is interactive or read from stdin"
    if mode[0] == "script":
        unrunnable = _unrunnable_script(mode[1])
        if unrunnable is not None:
            return unrunnable
    if has_controlling_terminal():
        return "it has a controlling terminal, which a forked program could not open (/dev/tty)"
    try:
        cwd = os.getcwd()
    except OSError:
        return "the working directory is gone"
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    pending: list[int] = []
    child: list[int] = []
    previous: dict[int, object] = {}

    # A process started as its own process group's leader (torchrun starts each rank so) is signalled
    # with its group (torchrun stops its ranks with killpg): the program's own processes are in that
    # group too in a plain run, and in the child's here.
    group = os.getpgrp() == os.getpid()

    def forward(signum, _frame):
        if child:
            _send_signal(_signal, child[0], signum, group)
        else:
            pending.append(signum)

    taken: tuple[int, list[int]] | str | None = None
    try:
        taken = _request(sock, path, argv, cwd, forward, previous)
    finally:
        if not isinstance(taken, tuple):
            _restore(_signal, previous, pending)
            sock.close()
    if not isinstance(taken, tuple):
        return taken
    pidfd, fds = taken
    # From here the program is the child's: this process only waits.
    child.append(pidfd)
    for signum in pending:
        _send_signal(_signal, child[0], signum, group)
    _release_fds(fds)
    sock.settimeout(None)
    _wait(_signal, sock, child[0])
    return None  # not reached


def _request(sock, path: str, argv: list[str], cwd: str, forward, previous: dict) -> tuple[int, list[int]] | str:
    """Ask the preloader to run this program: ``(pidfd of the child, descriptors passed)``, or why not."""
    import _signal

    from warmstart.preload import kernel_state, wire
    from warmstart.preload.environment import fingerprint

    sock.settimeout(HANDOVER_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError as exc:
        return f"no preloader answers at {path}: {exc.strerror or exc}"
    if wire.peer_uid(sock) != os.getuid():
        return f"the process at {path} belongs to another user"
    fds = _open_fds(sock.fileno())
    if len(fds) > wire.MAX_FDS:
        return f"{len(fds)} open file descriptors (at most {wire.MAX_FDS} are passed)"
    # Signals that arrive from here on are the program's: held until the child exists.
    for signum in _forwarded(_signal):
        try:
            previous[signum] = _signal.signal(signum, forward)
        except (OSError, ValueError):
            pass
    # What the preloader checks before it forks; the rest is read by its child alone, so that no
    # program's data stays in the preloader for the next one to inherit.
    isolation = kernel_state.isolation()
    check = {"op": "run", "protocol": wire.PROTOCOL, "fingerprint": fingerprint(), "isolation": isolation}
    ignored = [s for s, h in previous.items() if h == _signal.SIG_IGN]
    request = request_message(argv, cwd, fds, ignored, isolation)
    try:
        wire.send(sock, check)
        wire.send(sock, request, fds)
        reply, reply_fds = wire.receive(sock)
    except (OSError, EOFError, ValueError) as exc:  # a timeout too: the preloader is busy or stopped
        return f"the preloader did not take it: {exc}"
    if "running" in reply and reply_fds:
        return reply_fds[0], fds
    for fd in reply_fds:
        os.close(fd)
    return str(reply.get("declined", "the preloader's answer was not understood"))


def request_message(argv: list[str], cwd: str, fds: list[int], ignored: list[int], isolation: dict) -> dict:
    """What a preloader's child becomes the program from: this process's command line ``argv``,
    working directory, environment, umask, limits, cgroups, placement, the descriptors ``fds`` (sent
    with it), the signals it ignores and blocks."""
    import _signal

    from warmstart.preload import kernel_state

    return {
        "argv": argv,
        "cwd": cwd,
        "environ": dict(os.environ),
        "umask": _umask(),
        "rlimits": _rlimits(),
        "cgroup": kernel_state.read_proc("/proc/self/cgroup"),
        "isolation": isolation,
        "placement": kernel_state.placement(),
        "start_ts": _start_ts(),
        "fds": fds,
        "pid": os.getpid(),
        "ignored": ignored,
        "blocked": sorted(int(s) for s in _signal.pthread_sigmask(_signal.SIG_BLOCK, [])),
    }


def _wait(_signal, sock, pidfd: int) -> None:
    from warmstart.preload import wire

    try:
        wakeup = _signal_wakeup(_signal)
        while True:
            _until_readable(sock, wakeup)
            message, extra = wire.receive(sock)
            for fd in extra:
                os.close(fd)
            if "exit" in message:
                _exit_now(int(message["exit"]))
            if "signal" in message:
                _die_by(_signal, int(message["signal"]))
    except OSError:
        pass
    _try(os.write, 2, b"warmstart: the preloader that ran this program ended while it ran; the program ended with it\n")
    _exit_now(1)


def _signal_wakeup(_signal) -> int | None:
    """A descriptor that becomes readable when a signal arrives (``set_wakeup_fd``), or ``None``.

    Waiting on the socket alone can hold a signal back: one that arrives after the interpreter last
    ran its signal handlers and before the wait's system call starts interrupts nothing, and its
    handler (which forwards it to the program) would run only once the program has ended. A wait on
    this descriptor too returns for it at once.
    """
    try:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        _signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        return read_end
    except (OSError, ValueError):
        return None


def _until_readable(sock, wakeup: int | None) -> None:
    """Return when ``sock`` has data (or was closed). Signals that arrive meanwhile are forwarded as
    they arrive: their handlers run when the wait returns for them, or are interrupted by them."""
    if wakeup is None:
        return  # the receive blocks, as before
    import select

    try:
        poller = select.poll()  # not select(): descriptors may be numbered past its 1024
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(wakeup, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if wakeup in ready:
                try:
                    while os.read(wakeup, 512):
                        pass
                except OSError:  # drained
                    pass
            if sock.fileno() in ready:  # data, the end of the stream, or an error: the receive says which
                return
    except (OSError, ValueError):
        return  # the receive blocks, as before


def _die_by(_signal, signum: int) -> None:
    try:
        _signal.signal(signum, _signal.SIG_DFL)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    except (OSError, ValueError):
        pass
    _exit_now(128 + signum)  # a signal whose default is not to end the process


def _exit_now(code: int) -> None:
    os._exit(code)  # this process printed nothing and owns nothing: no interpreter shutdown


def _send_signal(_signal, pidfd: int, signum: int, group: bool = False) -> None:
    if group:
        # The child leads its own group, numbered as its pid (the pidfd's process, still unreaped:
        # the preloader reaps it only after telling this process of its end).
        try:
            os.killpg(_pid_of(pidfd), signum)
        except OSError:
            pass
    else:
        _try(_signal.pidfd_send_signal, pidfd, signum)
    if signum == getattr(_signal, "SIGTSTP", None):
        # Stopped the program; now this process, as ^Z at a terminal stops a process group.
        os.kill(os.getpid(), _signal.SIGSTOP)


def _pid_of(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
        for line in f:
            if line.startswith(b"Pid:"):
                return int(line.split()[1])
    raise OSError("no pid for the program")


def _try(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


def _forwarded(_signal) -> list[int]:
    skip = {getattr(_signal, name, None) for name in _UNCATCHABLE + _NOT_FORWARDED}
    return [s for s in range(1, _signal.NSIG) if s not in skip and _catchable(_signal, s)]


def _catchable(_signal, signum: int) -> bool:
    try:
        _signal.getsignal(signum)
        return True
    except (OSError, ValueError):
        return False


def _restore(_signal, previous: dict, pending: list[int]) -> None:
    for signum, handler in previous.items():
        try:
            _signal.signal(signum, handler)
        except (OSError, ValueError, TypeError):
            pass
    for signum in pending:  # arrived during a handover that did not happen: this process's after all
        _signal.raise_signal(signum)


def _open_fds(skip: int) -> list[int]:
    """The descriptors the program inherited: those without close-on-exec. The interpreter opens its
    own (``site`` reading this very ``.pth`` file, the listing here) close-on-exec, and a new
    interpreter's program would not find them open."""
    names = os.listdir("/proc/self/fd")  # the listing's own descriptor is closed again when it returns
    fds = []
    for name in names:
        fd = int(name)
        if fd == skip:
            continue
        try:
            if not os.get_inheritable(fd):
                continue
        except OSError:
            continue
        fds.append(fd)
    return sorted(fds)


def _release_fds(fds: list[int]) -> None:
    """Close this process's copies of what the child now holds, so that a pipe's reader sees its end
    when the program closes it. Standard error stays, for this process's last words."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd in (0, 1):
            os.dup2(devnull, fd)
        elif fd != 2:
            try:
                os.close(fd)
            except OSError:
                pass
    os.close(devnull)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _rlimits() -> dict[int, tuple[int, int]]:
    try:
        import resource
    except ImportError:
        return {}
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            number = getattr(resource, name)
            try:
                limits[number] = resource.getrlimit(number)
            except (OSError, ValueError):
                pass
    return limits


def _start_ts() -> float | None:
    from warmstart import _launch

    return _launch.process_start_ts()


def _info(line: str) -> None:
    import logging

    logging.getLogger("warmstart.preload").info(line)
