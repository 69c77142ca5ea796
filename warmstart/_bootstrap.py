"""Runs at interpreter start-up (from ``warmstart.pth``) in every Python process where ``WARMSTART`` is
set to anything but ``0`` (``1``: on; any other value: one line saying it is not valid).

It must stay cheap and must never break the interpreter: it installs import hooks, reads settings
and notes when the interpreter was ready (the end of the process's ``process_launch`` span, see
``warmstart._launch``); the store, Redis and torch are only touched when the process first
compiles. A bad setting prints one line and leaves warmstart off in this process.
"""

import os
import sys


def start(hand_over: bool = True) -> None:
    """Turn warmstart on in this process: first, unless ``hand_over`` is false, hand the process to
    a preloader that serves it (see ``warmstart.preload``), then read the settings and install the
    hooks."""
    if os.environ.get("WARMSTART_PRELOAD_SERVE"):
        _note_site_fingerprint()
    elif hand_over and os.environ.get("WARMSTART") == "1":
        _hand_over()
    try:
        from warmstart import _activate
        from warmstart.config import Settings

        settings = Settings.from_env()  # fail on a bad setting here, once, with one line
        _activate(settings)
    except Exception as exc:  # never break an interpreter because of the cache
        if not _quiet():
            sys.stderr.write(f"warmstart: disabled in this process: {exc}\n")
            os.environ["WARMSTART_QUIET_ERRORS"] = "1"  # children: say it once per job, not per process
    _mark_ready()


def _hand_over() -> None:
    try:
        from warmstart.preload.client import handover

        handover()  # returns unless a preloader runs the program (this process then ends with it)
    except Exception as exc:  # never break an interpreter because of the preloader
        if not _quiet():
            sys.stderr.write(f"warmstart: started without the preloader: {type(exc).__name__}: {exc}\n")


def _note_site_fingerprint() -> None:
    # In the preloader: what a process's start-up hook will see at this same point, to compare.
    try:
        from warmstart.preload import environment

        environment.site_fingerprint = environment.fingerprint()
    except Exception:
        pass


def _mark_ready() -> None:
    # The end of this process's `process_launch` span: the program starts running right after site's
    # .pth files (this hook included).
    try:
        from warmstart import _launch

        _launch.mark_interpreter_ready()
    except Exception:
        pass


def _quiet() -> bool:
    try:
        from warmstart.config import quiet_errors

        return quiet_errors()  # never raises, unlike the job identity it belongs to
    except Exception:  # warmstart itself does not import: say so
        return False


start()
