"""The preloader: one process that imports torch, TorchRec, torch's compiler and warmstart once, then
forks a child for each ``WARMSTART=1`` process that hands itself over (see
:mod:`warmstart.preload.client`).

It runs one thread and never touches CUDA, so that what it forks is whole: both are checked before
every fork, and a request is refused (the process starts as usual) when either does not hold. It
also refuses when anything its children would inherit has changed since it imported it (a module's
file, an installed package), when the process is of another user, or when its fingerprint (see
:mod:`warmstart.preload.environment`) is not the preloader's own.

Started by ``warmstart preload start``, which runs::

    python -c "import sys; ...; from warmstart.preload.server import main; main()" SOCKET MODULES

which first takes the working directory that ``-c`` put in front of ``sys.path`` off it (nothing it
imports, and no program it runs, may come from there), with ``WARMSTART=1`` and
``WARMSTART_PRELOAD_SERVE=1`` and only what its imports may read in its environment (see
:func:`warmstart.preload.control.preloader_environment`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from warmstart import torch_internals
from warmstart.config import take_preload_ready_fd
from warmstart.preload import environment, kernel_state, shutdown, wire
from warmstart.preload.handoff import DRY_RUN, Request
from warmstart.preload.watch import ImportedFiles, importable_entries, stamp
from warmstart.torch_internals import COMPILE_ENTRY_MODULES, COMPILER_MODULES

log = logging.getLogger("warmstart.preload")

#: What every preloader imports (``WARMSTART_PRELOAD_MODULES`` and ``--modules`` add to it). What is
#: not installed is skipped, and named in its status.
DEFAULT_MODULES = (
    "torch",
    *COMPILE_ENTRY_MODULES,
    "torch.distributed",
    "torch.utils.data",
    "torchrec",
    "torchrec.distributed",
    "torchrec.distributed.planner",
    "warmstart.metrics",
    "warmstart.compile_cache",
)

#: What warmstart imports when a process opens its cache store, at its first ``torch.compile`` call
#: (the tiers, single-flight, signing and what they need: SQLite, diskcache, redis-py's URL parsing,
#: Ed25519). A forked rank would otherwise import them on its first compile's critical path (about
#: 50 ms). Imported after the requested modules, when ``warmstart.compile_cache`` is among them.
STORE_MODULES = (
    "blake3",
    "cryptography.exceptions",
    "cryptography.hazmat.primitives.asymmetric.ed25519",
    "cryptography.hazmat.primitives.serialization",
    "diskcache",
    "encodings.idna",
    "sqlite3",
    "warmstart._fileio",
    "warmstart._threads",
    "warmstart.compile_cache.breaker",
    "warmstart.compile_cache.keyspace",
    "warmstart.compile_cache.local",
    "warmstart.compile_cache.miss_log",
    "warmstart.compile_cache.namespace",
    "warmstart.compile_cache.remote",
    "warmstart.compile_cache.remote_client",
    "warmstart.compile_cache.remote_leases",
    "warmstart.compile_cache.remote_registry",
    "warmstart.compile_cache.signing",
    "warmstart.compile_cache.single_flight",
    "warmstart.compile_cache.stats",
    "warmstart.compile_cache.tiered",
    "warmstart.compile_cache.wait_budget",
    "warmstart.metrics.live",
)

#: How old a check of the imported files that lie on a network filesystem (where the kernel does
#: not report changes made on other machines) may be when a request is served; the preloader checks
#: them again whenever it has been idle half this long. Files on local filesystems are watched
#: (:mod:`warmstart.preload.watch`): a change there is known at once.
STALE_CHECK_S = 1.0


@dataclass
class _Child:
    conn: socket.socket
    client_pid: int
    client_pidfd: int  # readable once the process that handed itself over has ended
    reason_fd: int  # why the child could not be set up, if it could not
    stopped: bool = False  # stopped here because its process was stopped
    told: bool = False  # its process was told of its end, which the child reported as it exited


#: How often the processes of running programs are looked at for a stop (SIGSTOP, which no process
#: can catch to pass on): a stopped process's program is stopped within this long.
STOP_CHECK_S = 0.02


#: How long a connection may take to send its request, waiting among the others (never holding them up).
REQUEST_TIMEOUT_S = 2.0


@dataclass
class Preloader:
    """The serving state of a preloader (in its one thread)."""

    path: str
    modules: list[str]
    site_fingerprint: dict
    imported: list[str] = field(default_factory=list)
    #: module -> why it was not imported (not installed, or its import failed)
    skipped: dict[str, str] = field(default_factory=dict)
    imports_s: float = 0.0
    started_at: float = field(default_factory=time.time)
    served: int = 0
    refused: Counter = field(default_factory=Counter)
    children: dict[int, _Child] = field(default_factory=dict)
    owner_pid: int = field(default_factory=os.getpid)
    #: its namespaces, credentials and confinement, which a process must share to be served
    isolation: dict = field(default_factory=kernel_state.isolation)
    _files: ImportedFiles | None = None
    _stopping: bool = False
    #: connections whose first message is not whole yet, and until when they may take to send it
    _pending: dict[socket.socket, float] = field(default_factory=dict)
    #: the empty directory the imports ran in (removed when it stops)
    _import_dir: str | None = None
    #: (device, inode) of the socket this preloader bound: what it unlinks, and what must still be
    #: at its path for anyone to reach it.
    _socket_id: tuple[int, int] | None = None

    def load(self) -> None:
        """Import the modules, then note every file they came from (to refuse once one changes)."""
        from warmstart.preload import child, recording

        start = time.perf_counter()
        seed_at_torch_import = None
        before = set(sys.modules)
        # in a directory of a name nothing else has: whatever the imports make of it can be told
        # by its name, and made of each program's own directory (see warmstart.preload.recording)
        self._import_dir = tempfile.mkdtemp(prefix="imports-", dir=os.path.dirname(os.path.abspath(self.path)))
        os.chdir(self._import_dir)
        with recording.recording() as reads:
            seed_at_torch_import = self._import_all()
        child.note_imports(reads, before)
        # What every child runs first, to become the program: imported once here, not in each child.
        child.note_generators(seed_at_torch_import)
        self.imports_s = time.perf_counter() - start
        _stop_blas_threads()
        _skip_library_teardown()
        files = _module_files()
        files.update({path: stamp(path) for path in reads.files})  # data files read at import
        if torch_internals.INTERNALS["codecache"].module in sys.modules:
            files.update(_hash_torch_sources())
        # Python's advice for a process that forks without exec: what exists now is never touched by
        # a child's garbage collector (its pages stay shared), and a child's gc.get_objects() holds
        # only what its program made.
        gc.collect()
        gc.freeze()
        shutdown.note_preloaded()
        # a package installed or removed in a sys.path directory; one that is not there yet is
        # watched as a file in its parent directory: made later, it stales the preloader too
        importable = {entry: importable_entries(entry) for entry in sys.path if os.path.isdir(entry)}
        files.update({entry: stamp(entry) for entry in sys.path if entry and not os.path.exists(entry)})
        self._files = ImportedFiles(files, importable)

    def _import_all(self) -> int | None:
        """Import the modules; torch's CPU seed right after ``import torch``, if it was imported."""
        seed_at_torch_import = None
        for name in self.modules:
            try:
                with _root_logger_left_alone() if name in DEFAULT_MODULES else contextlib.nullcontext():
                    importlib.import_module(name)
                self.imported.append(name)
                if seed_at_torch_import is None and "torch" in sys.modules:
                    seed_at_torch_import = sys.modules["torch"].initial_seed()
            except Exception as exc:  # a job's own module may raise anything: it is the job's to see
                log.info("warmstart preload: %s not imported (%s: %s)", name, type(exc).__name__, exc)
                self.skipped[name] = f"{type(exc).__name__}: {exc}"
        with _root_logger_left_alone():
            if "torch._dynamo" in self.imported:
                for name in COMPILER_MODULES:
                    with contextlib.suppress(ImportError):
                        importlib.import_module(name)
                _fill_dynamo_tables()
            if "warmstart.compile_cache" in self.imported:
                for name in STORE_MODULES:
                    with contextlib.suppress(ImportError):
                        importlib.import_module(name)
        return seed_at_torch_import

    def serve(self, listener: socket.socket) -> Request:
        """Serve requests on ``listener`` until stopped; returns only in a forked child, with its
        request."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: None)  # handled in the loop, from the wakeup pipe
        self._socket_id = _identity(self.path)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, "listener")
        selector.register(read_end, selectors.EVENT_READ, "signal")
        try:
            while not (self._stopping and not self.children):
                idle = STOP_CHECK_S if self.children else REQUEST_TIMEOUT_S / 4 if self._pending else STALE_CHECK_S / 2
                events = selector.select(timeout=idle)
                self._follow_stops()
                if not events:
                    # idle: read the change notifications queued meanwhile (all at once, rather than
                    # waking at each write a job makes in a watched directory), poll what is not watched
                    self._stale(max_age_s=STALE_CHECK_S / 2)
                    self._check_socket()
                for key, _ in events:
                    try:
                        if key.data == "signal":
                            self._on_signals(read_end, selector)
                        elif key.data == "listener":
                            self._accept(listener, selector)
                        elif key.data == "request":
                            request = self._on_request(key.fileobj, selector)  # type: ignore[arg-type]
                            if request is not None:  # in the child
                                self._become_child(listener, selector, read_end, write_end)
                                return request
                        else:  # a served process's pidfd; data: its child's pid
                            self._on_client_end(key.fileobj, key.data, selector)  # type: ignore[arg-type]
                    except Exception:  # one request's trouble must not end the preloader
                        if os.getpid() != self.owner_pid:
                            raise
                        log.exception("warmstart preload: serving a request failed")
                self._drop_idle(selector)
                if self._stopping and listener.fileno() >= 0:
                    selector.unregister(listener)
                    listener.close()
                    _unlink_own(self.path, self._socket_id)
        finally:
            if os.getpid() == self.owner_pid:
                _unlink_own(self.path, self._socket_id)
                if self._import_dir is not None:
                    with contextlib.suppress(OSError):
                        os.rmdir(self._import_dir)
        raise SystemExit(0)

    def status(self) -> dict:
        """What ``warmstart preload status`` shows."""
        threads, cuda = _threads(), _cuda_initialized()
        return {
            "pid": os.getpid(),
            "socket": self.path,
            "started_at": self.started_at,
            "imports_s": self.imports_s,
            "modules": self.imported,
            "skipped": self.skipped,
            "served": self.served,
            "refused": dict(self.refused),
            "running": len(self.children),
            "threads": threads,
            "cuda_initialized": cuda,
            "fork_safe": threads == 1 and not cuda,
            "stale": self._stale(),
            "files": self._files.describe() if self._files is not None else {},
            "executable": sys.executable,
            "fingerprint": self.site_fingerprint,
            "isolation": self.isolation,
        }

    # -- requests ---------------------------------------------------------------------------

    def _accept(self, listener: socket.socket, selector: selectors.BaseSelector) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if wire.peer_uid(conn) != os.getuid():
            self.refused["another user"] += 1
            conn.close()
            return
        # Read when its whole first message is there: a peer that connects and sends nothing, or
        # little, waits among the others and never holds up another process's start.
        conn.setblocking(False)
        self._pending[conn] = time.monotonic() + REQUEST_TIMEOUT_S
        selector.register(conn, selectors.EVENT_READ, "request")

    def _drop_idle(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for conn, deadline in list(self._pending.items()):
            if now > deadline:
                del self._pending[conn]
                selector.unregister(conn)
                conn.close()

    def _on_request(self, conn: socket.socket, selector: selectors.BaseSelector) -> Request | None:
        """Answer ``conn``'s first message once it is whole: a status, a stop, or a process's request
        to be run (its fingerprint and isolation only; its child reads the rest). Returns in the
        forked child only."""
        try:
            if not wire.message_ready(conn):
                return None
            ready = True
        except OSError:  # a first message too long for one, or a broken connection
            ready = False
        del self._pending[conn]
        selector.unregister(conn)
        conn.setblocking(True)
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            if not ready:
                raise wire.WireError("not a first message")
            message, fds = wire.receive(conn)  # whole already (or the end of the stream: it raises)
        except OSError:
            conn.close()
            return None
        for fd in fds:  # none belong in a first message
            os.close(fd)
        op = message.get("op")
        if op == "ended":
            self._on_ended(wire.peer_pid(conn), message)
            conn.close()
            return None
        if op == "status":
            _reply(conn, self.status())
            return None
        if op == "stop":
            self._stopping = True
            _reply(conn, {"stopping": True, "running": len(self.children)})
            return None
        reason = self._refusal(message)
        client_pidfd = -1
        if reason is None:
            try:
                client_pid = wire.peer_pid(conn)
                client_pidfd = os.pidfd_open(client_pid)
            except OSError as exc:
                reason = f"the process could not be watched ({exc.strerror})"
        if reason is not None:
            self.refused[reason.split(" (")[0]] += 1
            _reply(conn, {"declined": reason})
            return None
        reason_read, reason_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        pid = os.fork()
        if pid == 0:
            os.close(reason_read)
            os.close(client_pidfd)
            return Request(conn, reason_write, self.path)
        os.close(reason_write)
        self.served += 1
        self.children[pid] = _Child(conn, client_pid, client_pidfd, reason_read)
        selector.register(client_pidfd, selectors.EVENT_READ, pid)
        return None

    def _refusal(self, message: dict) -> str | None:
        if message.get("op") != "run" or message.get("protocol") != wire.PROTOCOL:
            return "a request of another warmstart version"
        if self._stopping:
            return "the preloader is stopping"
        differs = environment.difference(message.get("fingerprint", {}), self.site_fingerprint)
        if differs is not None:
            return f"this preloader serves another environment: {differs}"
        isolated = kernel_state.isolation_difference(message.get("isolation", {}), self.isolation)
        if isolated is not None:
            return f"the process runs with {isolated}"
        # A file that changes within STALE_CHECK_S of a request is as likely to be seen as by a new
        # interpreter that began importing that long ago (importing torch takes longer).
        stale = self._stale(max_age_s=STALE_CHECK_S)
        if stale is not None:
            return stale
        threads = _threads()
        if threads != 1:
            return f"the preloader runs {threads} threads, and a fork would lose all but one"
        if _cuda_initialized():
            return "the preloader has a CUDA context, which a fork cannot carry"
        return None

    def _stale(self, max_age_s: float | None = None) -> str | None:
        """Why what the preloader imported is out of date (a file changed since), or ``None``.
        ``None`` checks every file now; otherwise changes notified so far count, and polled files
        are checked again when their last check is older than ``max_age_s``."""
        if self._files is None:
            return None
        changed = self._files.check_all() if max_age_s is None else self._files.changed(max_age_s)
        if changed is None:
            return None
        return (
            f"{changed} changed since the preloader imported it "
            "(restart it: warmstart preload stop; warmstart preload start)"
        )

    def _check_socket(self) -> None:
        # Removed (a cleaner of /tmp or /run, a test's directory) or replaced by another preloader's:
        # no process can reach this one again, so it must not stay behind.
        if not self._stopping and _identity(self.path) != self._socket_id:
            log.info("warmstart preload: %s is no longer this preloader's socket; stopping", self.path)
            self._stopping = True

    def _on_ended(self, pid: int, message: dict) -> None:
        # A child's own report of its program's end, as it exits: passed on at once.
        child = self.children.get(pid)
        outcome = {k: int(message[k]) for k in ("exit", "signal") if isinstance(message.get(k), int)}
        if child is None or child.told or len(outcome) != 1:
            return
        child.told = True
        with contextlib.suppress(OSError):
            wire.send(child.conn, outcome)

    def _follow_stops(self) -> None:
        """Stop a program whose process is stopped (SIGSTOP: it cannot pass that on), and let it go
        on when the process does: the program, or its process group where the process leads its own
        (as its signals are passed on)."""
        for pid, child in self.children.items():
            state, group = _process_state(child.client_pid)
            if (state in ("T", "t")) == child.stopped or state is None:
                continue
            child.stopped = not child.stopped
            with contextlib.suppress(OSError):
                (os.killpg if group else os.kill)(pid, signal.SIGSTOP if child.stopped else signal.SIGCONT)

    def _on_client_end(self, client_pidfd: int, pid: int, selector: selectors.BaseSelector) -> None:
        # The process that handed itself over is gone (killed, perhaps with SIGKILL). Its program
        # must not outlive it.
        selector.unregister(client_pidfd)
        # The child itself only: what it started fares as a killed process's children do. (It
        # is this process's child until reaped here, so the pid is still its.)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

    def _on_signals(self, read_end: int, selector: selectors.BaseSelector) -> None:
        with contextlib.suppress(BlockingIOError):
            received = os.read(read_end, 512)
            if {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} & set(received):
                self._stopping = True
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            declined = b""
            with contextlib.suppress(OSError):
                declined = os.read(child.reason_fd, 4096)
            os.close(child.reason_fd)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(child.client_pidfd)  # its descriptor number is free for the next one
            os.close(child.client_pidfd)
            if declined:  # it never ran the program: the process starts as usual (or it was a dry run)
                self.served -= 1
                if declined != DRY_RUN:
                    self.refused[declined.decode(errors="replace").split(" (")[0]] += 1
            elif not child.told:
                ended = os.WIFSIGNALED(status)
                outcome = {"signal": os.WTERMSIG(status)} if ended else {"exit": os.WEXITSTATUS(status)}
                with contextlib.suppress(OSError):
                    wire.send(child.conn, outcome)
            child.conn.close()

    def _become_child(
        self, listener: socket.socket, selector: selectors.BaseSelector, read_end: int, write_end: int
    ) -> None:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for child in self.children.values():
            child.conn.close()
            os.close(child.client_pidfd)
            os.close(child.reason_fd)
        self.children.clear()
        for conn in self._pending:
            conn.close()
        self._pending.clear()
        selector.close()
        if self._files is not None:
            self._files.close()
        listener.close()
        os.close(read_end)
        os.close(write_end)


def main() -> None:
    """The preloader process (``python -c "...main()" SOCKET MODULES``)."""
    path, modules = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
    fingerprint = environment.site_fingerprint
    if fingerprint is None:
        sys.exit(
            "warmstart preload: the start-up hook did not run (WARMSTART=1 and WARMSTART_PRELOAD_SERVE=1 "
            "are needed); start it with `warmstart preload start`"
        )
    preloader = Preloader(path, modules, fingerprint)
    preloader.load()
    listener = _listen(path)
    _say_ready(preloader.status())
    request = preloader.serve(listener)
    from warmstart.preload.child import become

    become(request)


def _say_ready(status: dict) -> None:
    """Tell ``warmstart preload start`` (through the descriptor it passed) or the terminal that this
    preloader serves."""
    import json

    line = json.dumps({k: v for k, v in status.items() if k != "fingerprint"}) + "\n"
    fd = take_preload_ready_fd()
    if fd is None:
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    with contextlib.suppress(OSError):
        os.write(fd, line.encode())
        os.close(fd)


def _listen(path: str) -> socket.socket:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket: the start command checked that nobody answers on it
    old = os.umask(0o177)  # the socket is created 0600
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def _process_state(pid: int) -> tuple[str | None, bool]:
    """A process's state letter (``T``: stopped) and whether it leads its process group."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None, False
    return fields[0].decode(), int(fields[2]) == pid


def _identity(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _unlink_own(path: str, identity: tuple[int, int] | None) -> None:
    # Never another preloader's socket, started at the same path after this one's was removed.
    if identity is not None and _identity(path) == identity:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _reply(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    with contextlib.suppress(OSError):
        wire.send(conn, message)
    for fd in fds:
        os.close(fd)
    conn.close()


def _module_files() -> dict[str, tuple[int, int]]:
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        # a relative name is no file (torch.ops and torch.classes say "_ops.py" and "_classes.py")
        if isinstance(path, str) and os.path.isabs(path) and path not in files:
            files[path] = stamp(path)
    return files


@contextlib.contextmanager
def _root_logger_left_alone():
    """Keep the preloader's own imports from configuring the root logger. fbgemm_gpu (under
    TorchRec) logs with ``logging.info()`` when it is imported, which gives the root logger a
    handler when it has none (``basicConfig()``): every program forked from here would find it
    configured, and its own ``logging.basicConfig(...)`` would do nothing. Meanwhile a stand-in
    handler shows their warnings as Python's last-resort handler would."""
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    stand_in = logging.StreamHandler()
    stand_in.setLevel(logging.WARNING)
    stand_in.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(stand_in)
    try:
        yield
    finally:
        root.removeHandler(stand_in)


def _hash_torch_sources() -> dict[str, tuple[int, int]]:
    """Compute Inductor's hash of torch's source files (``torch_key()``, part of every FX graph and
    AOTAutograd cache key) once, so that no forked child spends its first compile on it (0.1-0.2 s of
    reading and hashing every module file under ``torch/``); returns the stamps of the files and
    directories it read, so that the preloader refuses to fork once one of them changes, as a new
    interpreter would hash them anew."""
    import pkgutil

    import torch

    codecache = torch_internals.resolve("codecache")
    if codecache is None:  # each child computes the hash, as before
        return {}
    try:
        codecache.torch_key()
    except Exception as exc:  # a torch whose key cannot be computed here: each child computes it, as before
        log.info("warmstart preload: torch's source hash not computed (%s)", exc)
        return {}
    stamps: dict[str, tuple[int, int]] = {}

    def walk(roots: list[str], prefix: str) -> None:
        # The walk of codecache.build_code_hash: every module file, and the directories whose
        # listing decides which files those are.
        for root in roots:
            stamps[root] = stamp(root)
        for info in pkgutil.iter_modules(roots, prefix):
            spec = info.module_finder.find_spec(info.name, None)
            if spec is None or spec.origin is None:
                continue
            stamps[spec.origin] = stamp(spec.origin)
            if info.ispkg and spec.submodule_search_locations:
                walk(list(spec.submodule_search_locations), f"{spec.name}.")

    walk([getattr(codecache, "_TORCH_PATH", os.path.dirname(torch.__file__))], "")
    inductor = os.path.dirname(codecache.__file__)
    for extra in ("codegen/aoti_runtime/interface.cpp", "script.ld"):
        stamps[os.path.join(inductor, extra)] = stamp(os.path.join(inductor, extra))
    return stamps


#: Packages whose modules' ``forward`` methods Dynamo inlines in most models (``torch.nn``'s layers,
#: TorchRec's MLP, cross and DeepFM modules).
_INLINED_PACKAGES = ("torch.nn.modules.", "torchrec.modules.")


def _fill_dynamo_tables() -> None:
    """Build the tables that Dynamo builds at the first compile of every process: torch's overridable
    functions, and the function names by line of each module file it inlines from (it tokenizes the
    whole file). Both depend only on the modules' code, which the preloader already watches: a forked
    child's first compile starts with them (20-40 ms of CPU less, on the reference job's model)."""
    try:
        funcname_cache = torch_internals.require("funcname_cache")
        torch_internals.require("get_overridable_functions")()
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if name.startswith(_INLINED_PACKAGES) and isinstance(path, str) and path.endswith(".py"):
                funcname_cache.get_funcname(path, 0)
    except Exception as exc:  # a torch without them: each child builds its own, as before
        log.info("warmstart preload: Dynamo's tables not built (%s)", exc)


def _stop_blas_threads() -> None:
    """End OpenBLAS's worker threads (numpy starts them when torch imports it). OpenBLAS does the same
    itself before every fork (its ``pthread_atfork`` handler) and starts them again at its next call;
    done once here, the preloader has one thread between forks, as it must."""
    import ctypes

    for path in sorted(
        {
            line.split()[-1]
            for line in _read_lines("/proc/self/maps")
            if "openblas" in line.rsplit("/", 1)[-1].lower() and ".so" in line
        }
    ):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).blas_thread_shutdown_()


def _skip_library_teardown() -> None:
    """Leave torch's operator libraries registered when a child exits: each ``torch.library.Library``
    deregisters its operators from the dispatcher in an ``atexit`` finalizer (about 40 ms for the
    250 a torch and TorchRec import makes), which changes nothing outside a process that ends with
    ``os._exit`` right after (see :mod:`warmstart.preload.child`)."""
    import weakref

    library = sys.modules.get("torch.library")
    teardown = getattr(library, "_del_library", None)
    if teardown is None:
        return
    for obj in gc.get_objects():
        if type(obj) is weakref.finalize:
            info = obj.peek()
            if info is not None and info[1] is teardown:
                obj.atexit = False


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False
