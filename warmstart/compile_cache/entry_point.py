"""What program this interpreter runs, as a name that repeats and restarts of it share: the
entry script's file name, ``pkg.mod`` for ``python -m``, ``-c <code>`` for ``python -c``. torch's PGO
state and the fetch-ahead manifest (``fetch_ahead.py``) are named after it."""

from __future__ import annotations

import os
import sys

#: Interpreter options that take a value (``-W arg``, ``-X opt``, ``--check-hash-based-pycs mode``).
_OPTIONS_WITH_VALUE = frozenset("WX")
_LONG_OPTIONS_WITH_VALUE = frozenset({"--check-hash-based-pycs"})


def entry_point() -> str:
    """What this interpreter runs: ``pkg.mod`` for ``python -m pkg.mod``, the script's file name
    for ``python dir/train.py`` (as before), ``-c <code>`` for ``python -c <code>``."""
    entry = _entry_from_command_line(list(getattr(sys, "orig_argv", None) or [])[1:])
    if entry:
        return entry
    main = sys.modules.get("__main__")  # an embedded interpreter, or a command line not understood
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python")


def _entry_from_command_line(args: list[str]) -> str | None:
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return os.path.basename(args[i + 1]) if i + 1 < len(args) else None
        if arg == "-":
            return "-"  # the program comes from standard input
        if arg.startswith("--"):
            i += 2 if arg in _LONG_OPTIONS_WITH_VALUE else 1
            continue
        if arg.startswith("-"):
            for j in range(1, len(arg)):  # a cluster of one-letter options: -Bu, -Im pkg.mod, -mpkg.mod
                letter = arg[j]
                if letter in ("m", "c"):
                    value = arg[j + 1 :] or (args[i + 1] if i + 1 < len(args) else "")
                    return value if letter == "m" else f"-c {value}"
                if letter in _OPTIONS_WITH_VALUE:
                    if not arg[j + 1 :]:
                        i += 1  # the value is the next argument
                    break
            i += 1
            continue
        return os.path.basename(arg)  # the script (or directory, or zip file)
    return None
