"""Ending a handed-over program as the interpreter ends one, for everything the program can observe.

The interpreter's own shutdown in a preloader's child would also tear down every module the
preloader imported (torch, TorchRec, the compiler: 0.3-1 s of freeing what nothing outside the
process can see, and of copying the pages it shares with the preloader). So the child does the
steps of ``Py_FinalizeEx`` that a program can observe, in its order, for what the program made,
and then exits at once:

1. the outcome, as the interpreter's top level handles it: ``SystemExit``'s code (a code that is
   not a number printed), or the exception printed by ``sys.excepthook`` after ``sys.last_type``,
   ``sys.last_value`` and ``sys.last_traceback`` are set, exit status 1;
2. the program's non-daemon threads joined, then its ``atexit`` handlers;
3. standard output and error flushed (standard output failing: "Exception ignored in: ..." and
   exit status 120, as the interpreter reports it);
4. the program's own modules (``__main__`` and every module imported after the fork) taken out of
   ``sys.modules`` and freed, those still referred to cleared as the interpreter clears a module
   (names with one leading underscore first), and the garbage collector run: their objects'
   finalizers run, files left open are closed (a gzip or zip file written whole, a temporary file
   removed);
5. what the program made that is still alive, held by a preloaded module: its files closed, its
   objects' ``__del__`` called;
6. standard streams flushed again, the end told to the preloader, and the exit: by SIGINT after an
   uncaught ``KeyboardInterrupt``.

The objects the preloader made are frozen (``gc.freeze``): the collector walks only the program's.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import sys
import types
import weakref
from typing import NoReturn

#: The module objects alive when the preloader forked (set by the preloader: :func:`note_preloaded`).
_PRELOADED: set[int] = set()

#: The exit status the interpreter gives when flushing standard output fails at exit.
FLUSH_FAILED_STATUS = 120


def note_preloaded() -> None:
    """In the preloader, before it serves: the modules alive now are not any program's own."""
    _PRELOADED.clear()
    _PRELOADED.update(id(module) for module in sys.modules.values())


def outcome_status(exc: BaseException | None, tb: types.TracebackType | None) -> int:
    """What the interpreter's top level does with a program's outcome: ``None`` (it returned),
    ``SystemExit`` or another exception (printed with ``tb``). Returns the exit status, negative for
    a signal to end by."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        return _exit_code(exc.code)
    exc.__traceback__ = tb  # the hook prints the exception's own traceback, whatever it is given
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_failed:  # as the interpreter reports a failing hook
        with contextlib.suppress(BaseException):
            print("Error in sys.excepthook:", file=sys.stderr)
            sys.__excepthook__(type(hook_failed), hook_failed, hook_failed.__traceback__)
            print("\nOriginal exception was:", file=sys.stderr)
            sys.__excepthook__(type(exc), exc, tb)
    return -int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else 1


def end(status: int) -> NoReturn:
    """Shut the program down (steps 2-6 of the module's docstring) and exit with ``status``."""
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    atexit._clear()  # as the interpreter drops its handlers after running them: what they hold is freed
    flushed = _flush_standard_streams()
    with contextlib.suppress(BaseException):
        _free_program_modules()
    with contextlib.suppress(BaseException):
        _finalize_leftovers()
    flushed = _flush_standard_streams() and flushed
    if not flushed and status != -int(signal.SIGINT):  # the interpreter ends by SIGINT all the same
        status = FLUSH_FAILED_STATUS
    _report(status)
    if status == -int(signal.SIGINT):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


#: Where the program's process tells its end, and which process it is (:func:`report_to`).
_REPORT: tuple[str, int] | None = None


def report_to(preloader_socket: str) -> None:
    """In a preloader's child, before the program runs: tell its end to the preloader at
    ``preloader_socket`` as it exits (from this process only, never from one the program forks)."""
    global _REPORT
    _REPORT = (preloader_socket, os.getpid())


def _report(status: int) -> None:
    # The process that handed itself over learns the end from here, before the kernel has torn down
    # this address space (tens of milliseconds for one that imported torch), which is when the
    # preloader would learn it. A new connection, made now: the program never sees one.
    if _REPORT is None or _REPORT[1] != os.getpid():
        return
    import socket

    from warmstart.preload import wire

    outcome = {"signal": -status} if status < 0 else {"exit": status & 0xFF}
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        sock.connect(_REPORT[0])
        wire.send(sock, {"op": "ended", "protocol": wire.PROTOCOL, **outcome})


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _flush_standard_streams() -> bool:
    """Flush ``sys.stdout`` (a failure reported as the interpreter reports it: ``False``) and
    ``sys.stderr`` (a failure ignored)."""
    ok = True
    out = sys.stdout
    if out is not None and not getattr(out, "closed", False):
        try:
            out.flush()
        except BaseException as exc:
            _unraisable(exc, out)
            ok = False
    with contextlib.suppress(BaseException):
        if sys.stderr is not None:
            sys.stderr.flush()
    return ok


def _program_modules() -> list[str]:
    """The names of the modules the program imported. Modules imported after the fork are at the end
    of ``sys.modules`` (its order is that of insertion): read from the end, up to the first preloaded
    one, without touching the rest (every object touched is a page copied from the preloader's)."""
    names = []
    for name, module in reversed(sys.modules.items()):
        if id(module) in _PRELOADED:
            break
        names.append(name)
    main = sys.modules.get("__main__")
    if main is not None and id(main) not in _PRELOADED and "__main__" not in names:
        names.append("__main__")  # put in the place of the preloader's own
    return names


def _free_program_modules() -> None:
    sys.last_type = sys.last_value = sys.last_traceback = None  # as finalize_modules_delete_special
    gc.collect()  # as the interpreter collects before it destroys modules: finalizers see them whole
    alive = []
    for name in _program_modules():
        with contextlib.suppress(TypeError):  # a module object that refuses weak references
            alive.append(weakref.ref(sys.modules[name]))
        del sys.modules[name]
    gc.collect()
    for ref in alive:  # still referred to: cleared in the reverse order of import (alive is)
        module = ref()
        if module is not None:
            _clear_module(module)
    gc.collect()


def _clear_module(module: types.ModuleType) -> None:
    # As _PyModule_ClearDict: names with one leading underscore first, then the rest but __builtins__.
    namespace = vars(module)
    for first in (True, False):
        for key in list(namespace):
            if key == "__builtins__" or not isinstance(key, str):
                continue
            if first == (key.startswith("_") and not key.startswith("__")):
                with contextlib.suppress(BaseException):
                    namespace[key] = None


def _finalize_leftovers() -> None:
    standard = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)}
    for obj in gc.get_objects():  # the program's objects only: the preloader's are frozen
        kind = type(obj)
        if id(obj) in standard:
            continue
        if issubclass(kind, io.IOBase):  # type(), not isinstance: no object's __class__ runs
            if not obj.closed:
                try:
                    obj.close()
                except BaseException as exc:
                    _unraisable(exc, obj)
        elif isinstance(getattr(kind, "__del__", None), types.FunctionType):
            try:
                obj.__del__()
            except BaseException as exc:
                _unraisable(exc, kind.__del__)


def _unraisable(exc: BaseException, obj: object) -> None:
    """Report ``exc`` as the interpreter reports an exception it cannot raise (``Exception ignored
    in: ...``), through ``sys.unraisablehook``."""
    with contextlib.suppress(BaseException):
        sys.unraisablehook(_unraisable_args(exc, obj))


def _unraisable_args(exc: BaseException, obj: object):
    # sys.UnraisableHookArgs is not exposed: its type is taken from a real report, caught once.
    caught: list = []
    hook = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:

        class _Raises:
            def __del__(self):
                raise RuntimeError

        _Raises()
    finally:
        sys.unraisablehook = hook
    return type(caught[0])((type(exc), exc, exc.__traceback__, None, obj))
