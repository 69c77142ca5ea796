"""This process's launch, as the OS and warmstart's start-up hook saw it: the two ends of its
``process_launch`` span (docs/metrics.md#how-wall-time-is-split).

It owns two measurements and nothing else: when the OS started the process (``/proc/self/stat``) and
when the interpreter was ready to run the program (noted by ``warmstart._bootstrap``, which runs from
``warmstart.pth`` at interpreter start where ``WARMSTART=1``). It imports only ``os`` and ``time``:
the start-up hook imports it in every such process, and the metrics read it when they start recording.
"""

from __future__ import annotations

import os
import time

interpreter_ready_ts: float | None = None
"""Unix time at which warmstart's start-up hook finished: the interpreter was ready to run the program.
``None`` when the hook did not run in this interpreter (``WARMSTART=1`` was not set when it started)."""


forked_start_ts: float | None = None
"""In a process the preloader forked: Unix time at which the OS started the process that handed
itself over (its launch began there, not at the fork). ``None`` in a process started as usual."""


def forked_at(start_ts: float | None) -> None:
    """Note that this process is a preloader's child serving a process started at ``start_ts``: its
    launch runs from then to now (the handover included) and the interpreter is ready now."""
    global forked_start_ts, interpreter_ready_ts
    forked_start_ts = start_ts if start_ts is not None else time.time()
    interpreter_ready_ts = None
    mark_interpreter_ready()


def mark_interpreter_ready() -> None:
    """Note now as the moment the interpreter was ready (the start-up hook calls it once, as it ends)."""
    global interpreter_ready_ts
    if interpreter_ready_ts is None:
        interpreter_ready_ts = time.time()


def process_start_ts() -> float | None:
    """Unix time at which the OS started this process (its fork), to a clock tick (10 ms usually).

    Read from ``/proc/self/stat`` (``starttime``, in clock ticks since boot) against the boot-time
    clock, not from ``/proc/stat``'s ``btime``, which is in whole seconds. ``None`` where there is no
    ``/proc`` (not Linux) or it cannot be read. In a preloader's child: when the process that handed
    itself over was started.
    """
    if forked_start_ts is not None:
        return forked_start_ts
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Fields after the command name, which may itself hold spaces and parentheses: field 3 onwards.
        fields = stat[stat.rindex(b")") + 2 :].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, seconds after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME here
        return None
