"""Compile cache: torch.compile and Triton artifacts shared through a local and a remote tier.

``open_store(settings)`` builds the tiered store a job uses; ``get_store()`` is the process-wide one
(``None`` while warmstart is off). ``torch_hooks.install()`` plugs the store into torch and Triton;
the ``.pth`` start-up hook does that in every process when ``WARMSTART=1``.
"""

from __future__ import annotations

import logging
import threading

from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.compile_cache.storage import KINDS, Storage
from warmstart.config import Settings

if TYPE_CHECKING:
    from warmstart.compile_cache.local import LocalTier
    from warmstart.compile_cache.remote import RemoteTier
    from warmstart.compile_cache.stats import Stats
    from warmstart.compile_cache.tiered import TieredStore

_LAZY = {"LocalTier": "local", "RemoteTier": "remote", "Stats": "stats", "TieredStore": "tiered"}


def __getattr__(name: str):
    # Tiers import redis, diskcache and zstandard: only pay for that when a store is built.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"warmstart.compile_cache.{_LAZY[name]}"), name)
    raise AttributeError(name)

__all__ = ["KINDS", "LocalTier", "RemoteTier", "Stats", "Storage", "TieredStore", "get_store", "open_store",
           "reset_store", "set_store", "stats_path"]

log = logging.getLogger("warmstart.cache")

_store: "TieredStore | None" = None
_store_lock = threading.Lock()
_store_loaded = False
_warned_no_secret = False


def stats_path(settings: Settings) -> Path:
    """Where processes sharing ``settings.cache_dir`` merge their counts."""
    return settings.cache_dir / "stats.json"


def open_store(settings: Settings | None = None, *, persist_stats: bool = True) -> "TieredStore | None":
    """Build the store ``settings`` describe (the environment when omitted).

    Returns ``None`` when the mode is ``off``. Without a secret the remote tier is refused with one
    warning and the store is local-only.

    Raises:
        ConfigError: a setting is malformed.
    """
    global _warned_no_secret
    from warmstart.compile_cache.local import LocalTier
    from warmstart.compile_cache.namespace import namespace
    from warmstart.compile_cache.remote import RemoteTier
    from warmstart.compile_cache.stats import Stats
    from warmstart.compile_cache.tiered import TieredStore

    settings = settings or Settings.from_env()
    if settings.mode == "off":
        return None
    stats = Stats()
    local = LocalTier(settings.cache_dir, settings.cache_size, stats)
    remote = None
    if settings.cache_url:
        if settings.secret:
            remote = RemoteTier(settings.cache_url, secret=settings.secret,
                                namespace=namespace(settings.namespace), stats=stats)
        elif not _warned_no_secret:
            log.warning("warmstart: WARMSTART_CACHE_URL is set but no WARMSTART_SECRET or WARMSTART_SECRET_FILE: "
                        "remote cache refused (unsigned entries would run unverified code); using the local tier only")
            _warned_no_secret = True
    return TieredStore(local, remote, mode=settings.mode, stats=stats,
                       stats_file=stats_path(settings) if persist_stats else None)


def get_store() -> "TieredStore | None":
    """The process-wide store, built on first use from the environment; ``None`` when warmstart is off."""
    global _store, _store_loaded
    if _store_loaded:
        return _store
    with _store_lock:
        if not _store_loaded:
            settings = Settings.from_env()
            _store = open_store(settings) if settings.enabled else None
            _store_loaded = True
    return _store


def reset_store() -> None:
    """Forget the process-wide store; the next :func:`get_store` builds it from the environment."""
    global _store, _store_loaded
    with _store_lock:
        _store, _store_loaded = None, False


def set_store(store: "TieredStore | None") -> None:
    """Make ``store`` the process-wide store (``warmstart.enable`` and tests use this)."""
    global _store, _store_loaded
    with _store_lock:
        _store, _store_loaded = store, True
