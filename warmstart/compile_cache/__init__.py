"""Compile cache: torch.compile and Triton artifacts shared through a local and a remote tier.

``open_store(settings)`` builds the tiered store a job uses; ``get_store()`` is the process-wide one
(``None`` while warmstart is off). ``torch_hooks.install()`` plugs the store into torch and Triton;
the ``.pth`` start-up hook does that in every process when ``WARMSTART=1``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import unquote, urlsplit

from warmstart.compile_cache.storage import KINDS, Hit, Miss, ReadOnly, Storage, StoreObserver, warn_once
from warmstart.config import Settings, redact_url

if TYPE_CHECKING:
    from warmstart.compile_cache import signing
    from warmstart.compile_cache.fetch_ahead import FetchAhead
    from warmstart.compile_cache.local import LocalTier
    from warmstart.compile_cache.miss_log import MissLog
    from warmstart.compile_cache.remote import RemoteTier
    from warmstart.compile_cache.single_flight import SingleFlight
    from warmstart.compile_cache.stats import Stats
    from warmstart.compile_cache.tiered import TieredStore
    from warmstart.compile_cache.wait_budget import WaitBudget

_LAZY = {"LocalTier": "local", "RemoteTier": "remote", "Stats": "stats", "TieredStore": "tiered"}


def __getattr__(name: str):
    # The store's parts load only when a store is built (the functions below import what each
    # uses): the tiers import redis, diskcache and zstandard, the keys blake3 and cryptography, and a
    # process that never compiles, or a preloader's client, pays for none of them.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"warmstart.compile_cache.{_LAZY[name]}"), name)
    raise AttributeError(name)


__all__ = [
    "KINDS",
    "Hit",
    "LocalTier",
    "Miss",
    "ReadOnly",
    "RemoteTier",
    "Stats",
    "Storage",
    "StoreObserver",
    "TieredStore",
    "add_observer",
    "get_store",
    "open_store",
    "reset_store",
    "set_store",
    "stats_path",
]

log = logging.getLogger("warmstart.cache")

_T = TypeVar("_T", bound=Storage)

_store: TieredStore | None = None
_store_lock = threading.Lock()
_store_loaded = False
_warned_no_secret = False
_observers: list[StoreObserver | Callable[[], StoreObserver]] = []


def add_observer(observer: StoreObserver | Callable[[], StoreObserver]) -> None:
    """Attach ``observer`` to the process-wide store, now and whenever it is built again.

    ``observer`` may also be a function that makes one, called only when a store is built: the
    start-up hook registers the metrics' observer that way, so a process that never touches the
    cache never imports the metrics.
    """
    if observer in _observers:  # enable() after the start-up hook: attach once
        return
    _observers.append(observer)
    if _store is not None:
        _attach(_store, [observer])


def _attach(store: TieredStore, observers: list) -> None:
    for observer in observers:
        try:
            made = observer if hasattr(observer, "looked_up") else observer()
            if made not in store.observers:
                store.add_observer(made)
        except Exception as exc:  # a broken observer (or a store without them) costs the reports, never the store
            warn_once("observer", "warmstart: a cache observer could not be attached (%s: %s)", type(exc).__name__, exc)


def stats_path(settings: Settings) -> Path:
    """Where processes sharing ``settings.cache_dir`` merge their counts."""
    return settings.cache_dir / "stats.json"


def open_store(settings: Settings | None = None, *, persist_stats: bool = True) -> TieredStore | None:
    """Build the store ``settings`` describe (the environment when omitted).

    Returns ``None`` when the mode is ``off``; in mode ``ro`` both tiers are wrapped in
    :class:`ReadOnly`, and so is the remote tier of a key that can only verify. With
    ``persist_stats`` the store merges its counts into the cache directory at exit and logs its
    misses for ``warmstart cache explain`` (see ``miss_log.py``). Entries are signed with ``settings.key_file``
    (Ed25519) when set, else with ``settings.secret`` (HMAC); with neither the remote tier is
    refused with one warning and the store is local-only.

    A tier that cannot be opened (a damaged or unwritable directory, one others can write, a key
    file or URL option the client refuses) is left out with one warning: the store is then
    local-only or remote-only, and ``None`` when neither tier is left. Nothing here raises once
    ``settings`` are built.

    Raises:
        ConfigError: ``settings`` omitted and a variable in the environment is malformed.
    """
    settings = settings or Settings.from_env()
    if settings.mode == "off":
        return None
    from warmstart.compile_cache.stats import Stats
    from warmstart.compile_cache.tiered import TieredStore
    from warmstart.compile_cache.wait_budget import WaitBudget

    stats = Stats()
    budget = WaitBudget(settings.max_wait_s)
    # keys: what remote entries are signed and verified with (none: no remote tier)
    settings, keys = _remote_keys(settings)
    key_id = keys.key_id if keys is not None else ""
    # tiers
    local_tier = _open_local(settings, stats, key_id)
    remote_tier = _open_remote(settings, keys, stats)
    if local_tier is None and remote_tier is None:
        return None
    # wrapping: a tier that may not be written is seen through a read-only view
    local = _read_only_unless_written(local_tier, settings)
    remote = _read_only_unless_written(remote_tier, settings)
    # observers
    observers: list[StoreObserver] = []
    if persist_stats:
        observers.append(_miss_log(settings, local, key_id if remote is not None else ""))
    # single-flight
    single_flight = _single_flight(settings, local, remote, remote_tier, stats, budget)
    # fetch ahead
    ahead = _fetch_ahead(settings, remote, remote_tier, budget)
    # Counts go next to a usable local tier only: never into a directory that was refused.
    return TieredStore(
        local,
        remote,
        stats=stats,
        observers=observers,
        single_flight=single_flight,
        budget=budget,
        ahead=ahead,
        stats_file=stats_path(settings) if persist_stats and local is not None else None,
    )


def _remote_keys(settings: Settings) -> tuple[Settings, signing.Keys | None]:
    """The keys of the remote tier, or ``None`` when there is no remote tier or no key for it.
    Keys that cannot be loaded turn the remote tier off (one warning): ``settings`` come back
    without a cache URL then."""
    if not settings.cache_url:
        return settings, None
    from warmstart.compile_cache import signing

    try:
        return settings, signing.keys_for(settings.key_file, settings.secret)
    except Exception as exc:  # this runs inside torch's hooks: a fault costs the tier, never the job
        _warn_remote_off(settings.cache_url, exc)
        return dataclasses.replace(settings, cache_url=None), None


def _open_remote(settings: Settings, keys: signing.Keys | None, stats: Stats) -> RemoteTier | None:
    """The remote tier, or ``None``: no URL, no key to sign or verify with (refused, one warning),
    or a URL the client refuses (one warning)."""
    global _warned_no_secret
    if not settings.cache_url:
        return None
    if keys is None:
        if not _warned_no_secret:
            log.warning(
                "warmstart: WARMSTART_CACHE_URL is set but no WARMSTART_SECRET, WARMSTART_SECRET_FILE or "
                "WARMSTART_KEY_FILE: remote cache refused (unsigned entries would run unverified code); "
                "using the local tier only"
            )
            _warned_no_secret = True
        return None
    # Imported here: redis and zstandard load only when a store has a remote tier.
    from warmstart.compile_cache.namespace import components, namespace
    from warmstart.compile_cache.remote import RemoteTier

    try:
        remote = RemoteTier(
            settings.cache_url,
            keys=keys,
            namespace=namespace(settings.namespace),
            components=components(settings.namespace),
            stats=stats,
        )
    except Exception as exc:  # this runs inside torch's hooks: a fault costs the tier, never the job
        _warn_remote_off(settings.cache_url, exc)
        return None
    if not keys.can_sign:
        log.info(
            "warmstart: %s key %s can only verify: reading the remote cache, never writing to it",
            keys.scheme,
            keys.key_id,
        )
    return remote


def _warn_remote_off(url: str, exc: Exception) -> None:
    warn_once(
        f"remote-open:{type(exc).__name__}",
        "warmstart: remote cache tier off: cannot use %s (%s: %s)",
        redact_url(url),
        type(exc).__name__,
        _scrub(str(exc), url),
    )


def _read_only_unless_written(tier: _T | None, settings: Settings) -> _T | ReadOnly[_T] | None:
    """``tier`` itself where this job writes to it; a read-only view of it in mode ``ro``, or where
    it cannot be written (the remote tier of a key that can only verify)."""
    if tier is None or (tier.writable and settings.mode != "ro"):
        return tier
    return ReadOnly(tier)


def _miss_log(settings: Settings, local: Storage | None, key_id: str) -> MissLog:
    """The observer that logs this process's misses for ``warmstart cache explain``: beside a usable
    local tier only."""
    from warmstart.compile_cache.miss_log import MissLog
    from warmstart.compile_cache.namespace import namespace

    return MissLog(
        None,
        settings.cache_dir if local is not None else None,
        namespace=namespace(settings.namespace),
        key_id=key_id,
    )


def _single_flight(
    settings: Settings,
    local: Storage | None,
    remote: Storage | None,
    remote_tier: RemoteTier | None,
    stats: Stats,
    budget: WaitBudget,
) -> SingleFlight | None:
    """Leases on misses (``None`` when ``compile_wait_s`` is 0): lock files beside the local tier,
    and the remote tier's leases, each taken only where this job writes to the tier."""
    if settings.compile_wait_s <= 0:
        return None
    from warmstart.compile_cache.single_flight import SingleFlight

    return SingleFlight(
        local_dir=settings.cache_dir if local is not None else None,
        local_writable=local is not None and local.writable,
        remote_leases=remote_tier.leases if remote_tier is not None else None,
        remote_writable=remote is not None and remote.writable,
        stats=stats,
        wait_s=settings.compile_wait_s,
        budget=budget,
    )


def _fetch_ahead(
    settings: Settings, remote: Storage | None, remote_tier: RemoteTier | None, budget: WaitBudget
) -> FetchAhead | None:
    """The remote tier's fetch ahead, named after this program (``None`` without a remote tier or
    with ``WARMSTART_FETCH_AHEAD=0``); begun at once when :func:`fetch_ahead_now` was called (its
    thread runs it), so that no lookup goes by it. It stores its manifest where this process writes
    to the remote tier (``remote``, the view of it this store uses)."""
    if remote_tier is None or remote is None or not settings.fetch_ahead:
        return None
    import hashlib

    from warmstart.compile_cache import fetch_ahead
    from warmstart.compile_cache.entry_point import entry_point

    name = hashlib.sha256(entry_point().encode()).hexdigest()[:32]
    ahead = fetch_ahead.FetchAhead(remote_tier, name, writes=remote.writable, budget=budget)
    remote_tier.ahead = ahead
    if _fetching_pid == os.getpid():
        ahead.begin()
    return ahead


def _open_local(settings: Settings, stats: Stats, key_id: str) -> LocalTier | None:
    """The local tier, or ``None`` (one warning) when its directory is unsafe or unusable."""
    # Imported here: diskcache loads only when a store is built.
    from warmstart.compile_cache.local import LocalTier, UnsafeCacheDir, check_private
    from warmstart.compile_cache.namespace import namespace

    try:
        if not settings.cache_dir_shared:
            check_private(settings.cache_dir)
        return LocalTier(
            settings.cache_dir, settings.cache_size, stats, namespace=namespace(settings.namespace), key_id=key_id
        )
    except UnsafeCacheDir as exc:
        warn_once(
            "local-unsafe",
            "warmstart: local cache tier off: %s, so others could run code in this job; "
            "make it yours and private (chmod 700), or set WARMSTART_CACHE_DIR_SHARED=1 if it is shared on "
            "purpose",
            exc,
        )
    except Exception as exc:  # a damaged database, a file in the way, no permission, a full disk
        warn_once(
            f"local-open:{type(exc).__name__}",
            "warmstart: local cache tier off: cannot open %s (%s: %s)%s",
            settings.cache_dir / "store",
            type(exc).__name__,
            exc,
            "; remove it to start afresh" if type(exc).__name__ == "DatabaseError" else "",
        )
    return None


def _scrub(text: str, url: str) -> str:
    """``text`` without the password of ``url`` (a client error may quote its connection string)."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return text
    return text.replace(password, "***").replace(unquote(password), "***") if password else text


_fetching_pid = 0  # the process that began fetching ahead (a forked child has not)
_fetch_when_compiling = False


def fetch_ahead_when_compiling(on: bool) -> None:
    """Whether :func:`fetch_ahead_now` fetches in this process (``Settings.fetches_ahead``), set when
    warmstart is turned on in it: decided then, so that the call itself reads no setting."""
    global _fetch_when_compiling
    _fetch_when_compiling = on


def fetch_ahead_now(_args: object = None) -> None:
    """Begin fetching ahead (``fetch_ahead.py``) in this process, once, on a thread that builds the
    process-wide store first: called when the process imports Dynamo (it is about to compile), and
    as Dynamo's start callback. Only where :func:`fetch_ahead_when_compiling` said so (not with
    ``WARMSTART_FETCH_AHEAD=0``, without a remote tier, in the preloader or a compile worker).
    Never raises."""
    global _fetching_pid
    if not _fetch_when_compiling or _fetching_pid == os.getpid():
        return
    _fetching_pid = os.getpid()
    try:
        from warmstart._threads import start_daemon

        start_daemon(_fetch_ahead_in_this_thread, "warmstart-fetch-ahead")
    except Exception:  # never a fault of the job's: its lookups ask the server
        _fetching_pid = 0  # no thread runs it: a store built now must not wait for it
        log.debug("fetch ahead did not start", exc_info=True)


def _fetch_ahead_in_this_thread() -> None:
    try:
        store = get_store()
        if store is not None and store.ahead is not None:
            store.ahead.run()
    except Exception:
        log.debug("fetch ahead did not start", exc_info=True)


def get_store() -> TieredStore | None:
    """The process-wide store, built on first use from the environment; ``None`` when warmstart is off
    or no tier could be opened. Never raises: torch's C++ build and Triton's cache call it."""
    global _store, _store_loaded
    if _store_loaded:
        return _store
    with _store_lock:
        if not _store_loaded:
            try:
                settings = Settings.from_env()
                _store = open_store(settings) if settings.enabled else None
                if _store is not None:
                    _attach(_store, _observers)
            except Exception as exc:  # called from torch's hooks: a bad setting turns the cache off, no more
                warn_once("settings", "warmstart: compile cache off in this process: %s", exc)
                _store = None
            _store_loaded = True
    return _store


def reset_store() -> None:
    """Forget the process-wide store; the next :func:`get_store` builds it from the environment.

    Its fetch ahead goes with it: the next store's begins at the next :func:`fetch_ahead_now` (the
    next compile's start), whose thread runs it, not at its build, when no thread would."""
    global _store, _store_loaded, _fetching_pid
    with _store_lock:
        _store, _store_loaded = None, False
        _fetching_pid = 0


def set_store(store: TieredStore | None) -> None:
    """Make ``store`` the process-wide store (``warmstart.enable`` and tests use this); the
    observers added with :func:`add_observer` are attached to it."""
    global _store, _store_loaded
    with _store_lock:
        _store, _store_loaded = store, True
        if store is not None:
            _attach(store, _observers)
