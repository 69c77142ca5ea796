"""What this process knows about compiled frames: the packages it made, what it installed, stored and
refused, and how its ``torch.compile`` calls compile. One :data:`STATE`, reset as a whole."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

from warmstart import torch_internals, torch_support
from warmstart.compile_cache import frame_reads

log = logging.getLogger("warmstart.cache")


@dataclasses.dataclass
class Package:
    """warmstart's record of one ``CompilePackage`` it made."""

    key: str | None = None
    label: str = "?"
    #: (module of the frame, guard source) -> the global's name in every process.
    identities: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    #: digest of a frame's serialized guards -> what its value guards saw (``frame_reads.guard_values``).
    values: dict[bytes, list] = dataclasses.field(default_factory=dict)
    #: calls Dynamo folded into constants without a guard while compiling these frames.
    folds: frame_reads.Folds = dataclasses.field(default_factory=frame_reads.Folds)
    #: why the frame being compiled cannot be packaged, found while tracing it.
    unpackaged: str | None = None
    dirty: bool = False
    compile_s: float = 0.0
    #: what the first call needs to find and install the stored frames (``None`` once it ran).
    pending: tuple | None = None
    #: held by the first call while it installs: a second thread's call waits instead of tracing
    #: into the package being installed.
    first_call: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class State:
    """This process's compiled-frames bookkeeping (one instance, :data:`STATE`)."""

    #: torch's ``CompilePackage`` -> warmstart's record of it, for the packages warmstart made.
    packages: weakref.WeakKeyDictionary[Any, Package] = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    #: guards every field below but the thread-locals.
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    #: ``.state``: the :class:`Package` of the frame this thread compiles.
    compiling: threading.local = dataclasses.field(default_factory=threading.local)
    #: ``.values``: the entry's recorded guard values while this thread installs it.
    loading: threading.local = dataclasses.field(default_factory=threading.local)
    #: whether this process packages frames, decided at first use with a store (see :func:`enabled`).
    enabled: bool | None = None
    #: keys whose frames this process installed.
    installed: set[str] = dataclasses.field(default_factory=set)
    #: keys whose stored frames this process could not use (warned once).
    refused: set[str] = dataclasses.field(default_factory=set)
    #: code objects this process put precompiled entries on.
    installed_codes: list = dataclasses.field(default_factory=list)
    #: how this process's ``torch.compile`` calls compile (``hooks.note_flavor``).
    flavors: set[str] = dataclasses.field(default_factory=set)
    #: why this process installs no frames (it compiles in two ways), once it does.
    mixed: str | None = None
    #: key -> fingerprint of the frames this process last read or wrote.
    stored: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def reset(self) -> None:
        """Forget what was decided from the settings and the store (``enabled``, ``refused``,
        ``stored``): a new ``warmstart.enable()`` may name another store. What describes torch's
        live objects stays (see :data:`KEPT_ON_RESET`)."""
        fresh = State()
        with self.lock:
            for field in dataclasses.fields(self):
                if field.name not in KEPT_ON_RESET:
                    setattr(self, field.name, getattr(fresh, field.name))


#: Fields :meth:`State.reset` keeps: they mirror objects that outlive a reset (torch's packages and
#: the precompiled entries put on code objects, the ``torch.compile`` calls already made, a compile
#: in flight on another thread, which may hold the lock).
KEPT_ON_RESET = frozenset(
    {"packages", "lock", "compiling", "loading", "installed", "installed_codes", "flavors", "mixed"}
)


STATE = State()


def enabled() -> bool:
    """Whether this process packages Dynamo's output: warmstart's store is open and
    ``WARMSTART_DYNAMO`` is not ``0``."""
    from warmstart.compile_cache import get_store

    if get_store() is None:
        return False
    if STATE.enabled is None:
        from warmstart.config import dynamo_frames_setting

        try:
            STATE.enabled = dynamo_frames_setting()
        except Exception:  # get_store() already warned about the setting
            STATE.enabled = False
        if STATE.enabled:
            STATE.enabled = _all_hooked()
    return STATE.enabled


def _all_hooked() -> bool:
    # A frame runs from the store only where every check warmstart adds is in place: with one of its
    # patches missing (torch changed), none runs, rather than some with fewer checks.
    if not torch_support.checked_here():  # off on a torch nobody checked, as its one warning said
        return False
    if not torch_support.frames_checked_here():
        torch_support.warn_frames_off()
        return False
    missing = torch_internals.unhooked(torch_internals.FRAMES_MODULES)
    missing += [
        torch_internals.INTERNALS[name].dotted for name in torch_internals.missing(torch_internals.FRAMES_INTERNALS)
    ]
    if missing:
        log.warning(
            "warmstart: compiled frames are off: %s could not be hooked; torch compiles every frame itself",
            ", ".join(missing),
        )
    return not missing


def reset() -> None:
    """Read ``WARMSTART_DYNAMO`` again at next use and forget what was read from or written to the
    store (``warmstart.enable()``, tests)."""
    STATE.reset()


def dynamo_compile_lock() -> Any:
    """Dynamo's own lock around frame compiles (reentrant: taken again inside a compile)."""
    return torch_internals.require("compile_lock")
