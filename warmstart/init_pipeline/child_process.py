"""Run one function in a forked child and bring its result back: heavy pure-Python work (sharding-plan
search) off the parent's GIL, so the parent's threads keep running at full speed.

Example:
    >>> import os
    >>> call_in_subprocess(os.getpid, name="pid") != os.getpid()
    True
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Mapping
from typing import Any


def call_in_subprocess(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    name: str = "subprocess",
) -> Any:
    """Run ``fn(**kwargs)`` in a forked child and return its (pickled) result.

    The child inherits the parent's memory, so nothing but the result crosses the process boundary;
    it holds its own GIL, so pure-Python work there does not slow the parent's threads. Where ``fork``
    is not available the call runs in the calling thread.

    Args:
        fn: the work; it must not use threads of the parent (they do not exist in the child).
        kwargs: its keyword arguments.
        timeout_s: kill the child and raise ``TimeoutError`` after this many seconds.
        name: used in error messages.

    Returns:
        What ``fn`` returned.

    Raises:
        Exception: what ``fn`` raised (re-raised in the parent when it pickles, else a ``RuntimeError``
            carrying its text and traceback), ``TimeoutError``, or ``RuntimeError`` if the child died.
    """
    kwargs = dict(kwargs or {})
    if "fork" not in multiprocessing.get_all_start_methods():
        return fn(**kwargs)
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(sender, fn, kwargs), name=f"warmstart-{name}", daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise TimeoutError(f"{name} did not finish within {timeout_s:g} s")
        try:
            status, payload = pickle.loads(receiver.recv_bytes())
        except EOFError:
            child.join(1.0)
            raise RuntimeError(f"{name} subprocess died (exit code {child.exitcode}) before returning") from None
    finally:
        receiver.close()
        if child.is_alive():
            child.join(0.5)
        if child.is_alive():
            child.kill()
            child.join(1.0)
    if status == "ok":
        return payload
    if isinstance(payload, BaseException):
        raise payload
    raise RuntimeError(f"{name} subprocess failed:\n{payload}")


def _child_main(sender: Any, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    try:
        result = ("ok", fn(**kwargs))
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            data = pickle.dumps(("error", exc), protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(data)  # an exception that pickles but does not unpickle would fail the parent
        except Exception:  # noqa: BLE001
            data = pickle.dumps(("error", "".join(traceback.format_exception(exc))))
    sender.send_bytes(data)
    sender.close()
    # Skip atexit hooks and finalizers inherited from the parent (stores, recorders, loggers).
    os._exit(0)
