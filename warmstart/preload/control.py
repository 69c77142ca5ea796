"""Starting, asking and stopping preloaders: what ``warmstart preload start|status|stop`` does."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from warmstart.config import preload_modules, preload_setting, preload_socket, warmstart_on
from warmstart.errors import WarmstartError
from warmstart.preload.client import handover_allowed, has_controlling_terminal

#: How long ``start`` waits for a new preloader to have imported everything and listen.
START_TIMEOUT_S = 300.0

#: The preloader's command: ``-c`` puts the working directory first on ``sys.path``, which no module
#: it imports and no program it runs may come from.
_SERVER = "import sys; sys.path[:1] == [''] and sys.path.pop(0); from warmstart.preload.server import main; main()"

#: Variables a preloader starts with besides the import-time ones (:mod:`warmstart.preload.environment`):
#: warmstart's own (less its secrets) and PATH, for a module that runs a program when imported.
_PRELOADER_NAMES = ("PATH",)
_SECRETS = ("WARMSTART_SECRET", "WARMSTART_CACHE_URL")


def start(
    modules: list[str] | None = None,
    socket_path: str | None = None,
    *,
    foreground: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    environ: dict[str, str] | None = None,
) -> dict:
    """Start a preloader for this user, interpreter and environment (``environ``, default this
    process's), and return its status once it serves (``socket``, ``pid``, ``modules``,
    ``imports_s``...). When one already serves there, its status (``already_running`` true), with
    the modules asked for now that it was not started with (``missing_modules``).
    ``foreground`` replaces this process with the preloader.

    Raises:
        WarmstartError: it did not start (its log's last lines are in the message).
    """
    from warmstart.preload.server import DEFAULT_MODULES

    base = dict(os.environ if environ is None else environ)
    path = socket_path or this_environment_socket(base)
    _check_socket_path(path)
    wanted = [*DEFAULT_MODULES, *preload_modules(base), *(modules or [])]
    running = status(path)
    if running is not None:
        tried = {*running.get("modules", []), *running.get("skipped", {})}
        return {
            **running,
            "already_running": True,
            "missing_modules": [m for m in dict.fromkeys(wanted) if m not in tried],
        }
    env = {**preloader_environment(base), "WARMSTART": "1", "WARMSTART_PRELOAD_SERVE": "1"}
    command = [sys.executable, "-c", _SERVER, path, ",".join(dict.fromkeys(wanted))]
    _private_dir(os.path.dirname(os.path.abspath(path)))
    if foreground:
        os.execve(sys.executable, command, env)
    log_path = os.path.splitext(path)[0] + ".log"
    read_end, write_end = os.pipe()
    env["WARMSTART_PRELOAD_READY_FD"] = str(write_end)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            pass_fds=(write_end,),
            close_fds=True,
        )
    os.close(write_end)
    try:
        ready = _read_ready(read_end, process, timeout_s)
    finally:
        os.close(read_end)
    if ready is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        raise WarmstartError(f"the preloader did not start; last lines of {log_path}:\n{_tail(log_path)}")
    return {**ready, "already_running": False, "log": log_path}


def preloader_environment(environ: dict[str, str]) -> dict[str, str]:
    """What a preloader for processes started with ``environ`` starts with: only what its imports may
    read (the import-time variables, warmstart's settings less its secrets, ``PATH``). Every child
    can read its preloader's start-up environment (``/proc/self/environ``): nothing else of the
    environment it was started from may be there. And as a shell would pass it: see
    :func:`as_started`."""
    from warmstart.preload import environment

    environ = as_started(environ)
    kept = environment.import_time_environment(environ)
    for name, value in environ.items():
        if name in _PRELOADER_NAMES or (name.startswith("WARMSTART") and not name.startswith(_SECRETS)):
            kept[name] = value
    return kept


def as_started(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` as the shell that started this process gave it: without the ``LC_CTYPE`` that
    Python adds to its own environment when it coerces the C locale (a shell with no ``LANG``). A
    process the shell starts has none; a preloader or probe started with it would not run in
    UTF-8 mode, as that process does, and would never serve it."""
    coerced = (
        sys.flags.utf8_mode
        and "PYTHONUTF8" not in environ
        and "LC_ALL" not in environ
        and environ.get("LC_CTYPE") in ("C.UTF-8", "C.utf8", "UTF-8")
        and environ.get("LANG", "C") in ("", "C", "POSIX")
    )
    if not coerced:
        return dict(environ)
    return {name: value for name, value in environ.items() if name != "LC_CTYPE"}


def status(socket_path: str | None = None) -> dict | None:
    """The status of the preloader at ``socket_path`` (default: this environment's), ``None`` when
    none answers there."""
    from warmstart.preload import wire

    path = socket_path or this_environment_socket()
    try:
        with _connect(path) as sock:
            wire.send(sock, {"op": "status", "protocol": wire.PROTOCOL})
            message, fds = wire.receive(sock)
    except OSError:
        return None
    for fd in fds:
        os.close(fd)
    return message


def stop(socket_path: str | None = None, timeout_s: float = 10.0) -> dict | None:
    """Stop the preloader at ``socket_path`` (default: this environment's): it serves no new process
    and ends once the programs it runs have ended. Its last status, ``None`` when none answered."""
    from warmstart.preload import wire

    path = socket_path or this_environment_socket()
    last = status(path)
    if last is None:
        return None
    try:
        with _connect(path) as sock:
            wire.send(sock, {"op": "stop", "protocol": wire.PROTOCOL})
            wire.receive(sock)
    except OSError:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and os.path.exists(path):
        time.sleep(0.02)
    return last


def preloaders() -> list[dict]:
    """The status of every preloader of this user (one per interpreter and environment)."""
    from warmstart.preload.environment import private_dir

    found = []
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        paths.update(os.path.join(private_dir(), n) for n in os.listdir(private_dir()) if n.endswith(".sock"))
    given = preload_socket()
    if given:
        paths.add(given)
    for path in sorted(paths):
        answer = status(path)
        if answer is not None:
            found.append(answer)
    return found


def this_environment_socket(environ: dict[str, str] | None = None) -> str:
    """Where the preloader for a ``python`` started with ``environ`` (default: this process's) would
    listen (``WARMSTART_PRELOAD_SOCKET``, else a path per user and fingerprint, as that
    interpreter's start-up hook sees it)."""
    base = dict(os.environ if environ is None else environ)
    given = preload_socket(base)
    if given:
        return given
    probe = "from warmstart.preload import environment as e; print(e.default_socket(fp=e.site_fingerprint))"
    env = {**as_started(base), "WARMSTART": "1", "WARMSTART_PRELOAD_SERVE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or not out.stdout.strip():
        raise WarmstartError(f"could not tell this environment's preloader socket: {out.stderr.strip()[-500:]}")
    return out.stdout.strip().splitlines()[-1]


def would_hand_over(environ: dict[str, str] | None = None) -> tuple[bool, str]:
    """Whether a ``python`` started with ``environ`` (default: this one) would be handed over, and why
    (not)."""
    environ = dict(os.environ if environ is None else environ)
    if not warmstart_on(environ):
        return False, "WARMSTART is not 1: warmstart is off in the process"
    if not handover_allowed(environ):
        return False, f"WARMSTART_PRELOAD={preload_setting(environ)}"
    # Asked from a new interpreter, whose start-up hook sees what the process's would.
    probe = "from warmstart.preload.control import _print_verdict; _print_verdict()"
    env = {**as_started(environ), "WARMSTART_PRELOAD_SERVE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    try:
        served, why = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"could not tell: {out.stderr.strip()[-300:]}"
    return bool(served), str(why)


def _print_verdict() -> None:
    """In the probe interpreter of :func:`would_hand_over`: print ``[served, why]`` as JSON."""
    from warmstart.preload import environment, kernel_state

    fingerprint = environment.site_fingerprint or {}
    path = environment.default_socket(fp=fingerprint)
    answer = status(path)
    if answer is None:
        verdict = [False, f"no preloader serves this environment (none answers at {path})"]
    elif (why := environment.difference(fingerprint, answer.get("fingerprint", {}))) is not None:
        verdict = [False, f"the preloader at {path} serves another environment: {why}"]
    elif isolated := kernel_state.isolation_difference(kernel_state.isolation(), answer.get("isolation", {})):
        verdict = [False, f"not handed over to the preloader at {path}: this process runs with {isolated}"]
    elif answer.get("stale"):
        verdict = [False, answer["stale"]]
    elif not answer.get("fork_safe"):
        verdict = [
            False,
            f"the preloader at {path} is not fork-safe: {answer.get('threads')} threads, "
            f"CUDA {'on' if answer.get('cuda_initialized') else 'off'}",
        ]
    elif (declined := _declined_by_a_child(path, fingerprint)) is not None:
        verdict = [False, f"not handed over to the preloader at {path}: {declined}"]
    elif has_controlling_terminal():
        verdict = [
            False,
            f"started at this terminal, a program is not (it could not open /dev/tty); one started without "
            f"a terminal (torchrun's ranks) is: the preloader at {path} (pid {answer.get('pid')}) serves "
            f"this environment",
        ]
    else:
        verdict = [True, f"the preloader at {path} (pid {answer.get('pid')}) serves this environment"]
    print(json.dumps(verdict))


def _declined_by_a_child(path: str, fingerprint: dict) -> str | None:
    """Ask the preloader at ``path`` to fork a child that checks this process (``python -c`` in this
    directory, with this environment) as it would check one to run, and ends: why it would refuse
    it, or ``None``. What only the child can tell (a variable the preloaded modules read, a module
    here that would shadow one of theirs, the stack limit...) is then what ``doctor`` says too."""
    from warmstart.preload import client, kernel_state, wire

    isolation = kernel_state.isolation()
    check = {"op": "run", "protocol": wire.PROTOCOL, "fingerprint": fingerprint, "isolation": isolation}
    request = {
        **client.request_message([sys.executable, "-c", "pass"], os.getcwd(), [], [], isolation),
        "dry_run": True,
    }
    try:
        with _connect(path) as sock:
            sock.settimeout(client.HANDOVER_TIMEOUT_S)
            wire.send(sock, check)
            wire.send(sock, request)
            reply, fds = wire.receive(sock)
    except OSError as exc:
        return f"the preloader did not answer ({exc})"
    for fd in fds:
        os.close(fd)
    return None if reply.get("would_run") else str(reply.get("declined", "no answer"))


def _connect(path: str):
    import socket

    from warmstart.preload import wire

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(path)
        if wire.peer_uid(sock) != os.getuid():
            raise PermissionError(f"the process at {path} belongs to another user")
    except BaseException:
        sock.close()
        raise
    return sock


def _read_ready(fd: int, process: subprocess.Popen, timeout_s: float) -> dict | None:
    import select

    deadline, data = time.monotonic() + timeout_s, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
            if data.endswith(b"\n"):
                return json.loads(data)
        elif process.poll() is not None:
            break
    return None


#: The longest path a UNIX socket can be bound to on Linux (``sun_path`` holds 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


def _check_socket_path(path: str) -> None:
    size = len(os.fsencode(os.path.abspath(path)))
    if size > MAX_SOCKET_PATH:
        raise WarmstartError(
            f"the preloader's socket path {path} is {size} bytes long; a UNIX socket's path holds at most "
            f"{MAX_SOCKET_PATH}: choose a shorter --socket or WARMSTART_PRELOAD_SOCKET"
        )


def _private_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise WarmstartError(
            f"cannot create the preloader's directory {path} ({exc.strerror}): choose a --socket or "
            "WARMSTART_PRELOAD_SOCKET in a directory you can write"
        ) from None
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(path) or os.path.islink(path):
        raise WarmstartError(
            f"{path} must be a directory of yours that nobody else can open (mode 0700); "
            "remove it, or set WARMSTART_PRELOAD_SOCKET to a path in a private directory"
        )


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"
