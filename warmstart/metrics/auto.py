"""Automatic events when ``WARMSTART=1``: compile spans from torch's own compile callbacks.

This module owns the glue between torch internals and the process-wide recorder, nothing else.
Dynamo calls its start callbacks when the outermost compilation of a frame (or a deferred backward
compile) begins and its end callbacks when it finishes (``torch._dynamo.callback.callback_handler``
counts nested compiles, so the spans never nest). The recorder is looked up at compile time, not at
install time, so installing costs nothing in processes that never compile (Inductor's compile
workers included).
"""

from __future__ import annotations

import threading

from warmstart import torch_internals
from warmstart.metrics.recorder import get_recorder

_installed = False
_lock = threading.Lock()


def _on_start(args: object) -> None:
    get_recorder().begin("compile")


def _on_end(args: object) -> None:
    get_recorder().end("compile")


def install_compile_spans() -> bool:
    """Record a ``compile`` span on the process-wide recorder around every torch.compile compilation.

    Idempotent. Returns True when the callbacks are (now or already) registered, False when this torch
    has no compile callback API (nothing is recorded then).
    """
    global _installed
    with _lock:
        if _installed:
            return True
        callback_handler = torch_internals.resolve("callback_handler")
        if callback_handler is None:
            return False
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)
        _installed = True
        return True


def uninstall_compile_spans() -> None:
    """Remove the callbacks :func:`install_compile_spans` registered (for tests and embedders)."""
    global _installed
    with _lock:
        if not _installed:
            return
        callback_handler = torch_internals.require("callback_handler")
        for registry, callback in (
            (callback_handler.start_callbacks, _on_start),
            (callback_handler.end_callbacks, _on_end),
        ):
            if callback in registry:
                registry.remove(callback)
        _installed = False
