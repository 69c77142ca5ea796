"""warmstart: win back the wall time training jobs lose outside training.

Turn it on with the environment alone (``WARMSTART=1``; see docs/reference.md), or from Python::

    import warmstart
    warmstart.enable(cache_url="redis://cache:6379/0", key_file="/etc/warmstart/verify.pub")
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmstart.config import Settings

__version__ = "0.1.0"
__all__ = ["enable", "__version__"]


def enable(
    *,
    cache_url: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    cache_size: str | None = None,
    mode: str | None = None,
    secret: str | None = None,
    secret_file: str | os.PathLike | None = None,
    key_file: str | os.PathLike | None = None,
    namespace: str | None = None,
    compile_wait_s: float | None = None,
    max_wait_s: float | None = None,
    dynamo: bool | None = None,
    run_dir: str | os.PathLike | None = None,
    job_id: str | None = None,
) -> None:
    """Turn warmstart on in this process and the processes it starts.

    Arguments beat environment variables, which beat defaults. They are exported to the
    environment, so torchrun workers and Inductor's compile workers use the same settings.

    ``key_file`` (``WARMSTART_KEY_FILE``) is an Ed25519 key in PEM: the private key (``signing.key``)
    for jobs that write the shared cache, the public key (``verify.pub``) for jobs that only read
    it. It wins over ``secret``/``secret_file`` (the HMAC secret of older setups) when both are given.
    ``compile_wait_s`` (``WARMSTART_COMPILE_WAIT_S``) bounds how long a process waits for another
    one compiling the entry it missed; 0 turns single-flight compiles off. ``max_wait_s``
    (``WARMSTART_MAX_WAIT_S``, 60 s) bounds the time it spends waiting on the cache in total. ``dynamo``
    (``WARMSTART_DYNAMO``, off by default) shares Dynamo's output, so new machines skip tracing the
    frames another one compiled.

    Raises:
        ConfigError: a setting is malformed (one line: variable, value, what is accepted).
    """
    from warmstart.config import Settings, enable_environment, ensure_job_id

    env = enable_environment(  # checks everything before changing anything
        os.environ,
        cache_url=cache_url,
        cache_dir=cache_dir,
        cache_size=cache_size,
        mode=mode,
        secret=secret,
        secret_file=secret_file,
        key_file=key_file,
        namespace=namespace,
        compile_wait_s=compile_wait_s,
        max_wait_s=max_wait_s,
        dynamo=None if dynamo is None else int(bool(dynamo)),
        run_dir=run_dir,
        job_id=job_id,
    )
    os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
    settings = Settings.from_env()
    # The PGO state is named before an id is generated: a generated id is new on every run, and
    # repeats of a job should share what Dynamo learnt.
    _activate(settings)
    ensure_job_id(settings.job)  # children share one generated id


def _activate(settings: Settings) -> None:
    """Install the hooks for ``settings``, those in ``os.environ`` (``WARMSTART=1`` already checked).

    Dynamo's PGO state is named after the job id the user gave, else after the entry script.
    """
    from warmstart import compile_cache, torch_internals
    from warmstart.compile_cache import dynamo_frames, import_hooks, torch_hooks

    torch_hooks.configure_environment(os.environ, job_id=settings.job.given_job_id or None)
    compile_cache.reset_store()  # the next get_store() builds from the settings now in force
    dynamo_frames.reset()
    # Compile spans for the ETT metrics, registered once torch's compile callbacks exist: importing
    # them here would import all of torch into every process.
    import_hooks.on_import(torch_internals.INTERNALS["callback_handler"].module, _install_compile_spans)
    # In torchrun's own process: its restarts rejoin without the first join's delay.
    import_hooks.on_import("torch.distributed.elastic.rendezvous.dynamic_rendezvous", _rejoin_at_once)
    compile_cache.add_observer(_cache_spans)
    # Decided now, from the settings in force: the preloader records what its imports read from the
    # environment, and Dynamo's import (which begins the fetch) is one of them.
    compile_cache.fetch_ahead_when_compiling(settings.fetches_ahead)
    torch_hooks.install()  # also runs the hooks of modules already imported


def _cache_spans():
    # Made when the store is first built: a process that never uses the cache never imports the metrics.
    from warmstart.metrics.cache_spans import CacheSpans

    return CacheSpans()


def _rejoin_at_once(module: ModuleType) -> None:
    # Imported only in a process that imports torch's rendezvous (torchrun), not at every start.
    from warmstart import rendezvous

    rendezvous.patch(module)


def _install_compile_spans(_module: object) -> None:
    from warmstart import compile_cache, torch_internals
    from warmstart.metrics import install_compile_spans

    install_compile_spans()
    # A process that imports Dynamo is about to compile: fetch the remote entries its program looked
    # up last time while the compiler's modules import (a preloaded program, whose preloader imported
    # them, at its first compile: a program that never compiles gets no thread, as in a new interpreter).
    compile_cache.fetch_ahead_now()
    handler = torch_internals.resolve("callback_handler")
    if handler is not None and compile_cache.fetch_ahead_now not in handler.start_callbacks:
        handler.register_start_callback(compile_cache.fetch_ahead_now)
