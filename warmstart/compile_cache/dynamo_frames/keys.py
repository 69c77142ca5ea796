"""What names stored frames: the key of a compiled function's entry and of its variants, the id of the
backend options it compiles with, and digests of the code entries an entry would install."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import types
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache.dynamo_frames.state import enabled
from warmstart.compile_cache.dynamo_identity import code_digest, code_qualname, global_identity, stable_repr

log = logging.getLogger("warmstart.cache")

KIND = "dynamo_frames"
#: The layout of a stored entry; part of every key.
FORMAT = 3


def entry_key(function: types.FunctionType, module: Any, backend_id: str, dynamic: Any, fullgraph: bool) -> str | None:
    """The key of ``function``'s frames: the function (module, qualified name, code), the module's
    structure (``repr``) when a module is compiled, the backend's options, ``dynamic``,
    ``fullgraph`` and every setting of torch's Dynamo, AOTAutograd and Inductor configs but those that
    say where or how fast, not what, it compiles (:data:`_NOT_WHAT_IS_COMPILED`); ``None`` when a
    setting cannot be described the same in every process (a custom pass with no ``uuid()``): its
    frames are not packaged."""
    configs = [torch_internals.require(name) for name in ("dynamo_config", "functorch_config", "inductor_config")]
    h = hashlib.sha256()
    for part in (
        f"format={FORMAT}",
        function.__module__,
        function.__qualname__,
        code_digest(function.__code__),
        f"{type(module).__module__}.{type(module).__qualname__}\n{module!r}" if module is not None else "",
        backend_id,
        f"dynamic={dynamic} fullgraph={fullgraph}",
    ):
        h.update(part.encode() + b"\0")
    for config in configs:
        try:
            h.update(compile_settings(config).encode() + b"\0")
        except UndescribedSetting as exc:
            log.debug("warmstart: the frames of %s are not packaged (traced on new machines): %s", function, exc)
            return None
    return h.hexdigest()


#: Settings that say where output goes, which caches torch itself uses or how many workers compile:
#: the same frames whatever they are. Every other setting, private ones and custom passes among them,
#: is part of the key (torch's own ``save_config_portable`` leaves out private settings and passes).
_NOT_WHAT_IS_COMPILED = (
    "trace.",
    "cuda.cutlass_dir",
    "cutlass.cutlass_dir",
    "xpu.cutlass_dir",
    "worker_start_method",
    "compile_threads",
    "fx_graph_cache",
    "fx_graph_remote_cache",
    "autotune_local_cache",
    "autotune_remote_cache",
    "pre_grad_pass_timing",
    "_save_config_ignore",
    "_cache_config_ignore_prefix",
    "_cache_config_factory_keys",
)


class UndescribedSetting(Exception):
    """A compiler setting holds an object with no description that is the same in every process."""


def compile_settings(config: types.ModuleType) -> str:
    """The settings of one of torch's config modules that decide what it compiles, the same in every
    process. Raises :class:`UndescribedSetting`."""
    settings = []
    for name, value in sorted(config.get_config_copy().items()):
        # Paths (where torch is installed, where debug output goes: the working directory) are this
        # machine's and change nothing Dynamo or Inductor produce.
        if name.startswith(_NOT_WHAT_IS_COMPILED) or (isinstance(value, str) and os.path.isabs(value)):
            continue
        settings.append((name, _setting(name, value)))
    return stable_repr(settings)


def _setting(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_setting(name, v) for v in value)
    if isinstance(value, dict):
        return {_setting(name, k): _setting(name, v) for k, v in value.items()}
    uuid = getattr(value, "uuid", None)
    if callable(uuid):  # torch's custom passes and choices classes name themselves by it
        return f"{type(value).__module__}.{type(value).__qualname__} uuid {uuid()!r}"
    identity = global_identity(value)
    if identity is not None:
        return identity
    raise UndescribedSetting(f"the setting {name} is a {type(value).__qualname__} with no uuid()")


def variant_key(key: str, variant: str) -> str:
    """The key of one variant of ``key``'s frames (``frame_reads.variant``: what the calls Dynamo
    folded into constants give)."""
    return hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()


def backend_id(backend: Any, kwargs: dict) -> str | None:
    """Inductor's options as a stable string; ``None`` when this compile is not packaged: another
    backend, a ``guard_filter_fn`` (it drops guards on purpose), torch's own precompile, or off."""
    if kwargs.get("package") is not None or kwargs.get("guard_filter_fn") is not None or not enabled():
        return None
    if torch_internals.require("dynamo_config").caching_precompile:
        return None
    if backend == "inductor":
        return "inductor"
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        config = getattr(backend, "config", {})
        if config.get("triton.cudagraphs"):
            return None  # torch loads a packaged graph with the global CUDA-graphs flag, not the mode's
        options = sorted((str(k), stable_repr(v)) for k, v in config.items())
        return f"inductor {options} dynamic={getattr(backend, 'dynamic', None)}"
    return None


def flavor(backend_id: str, kwargs: dict) -> str:
    """How a packaged context compiles: the backend's options (``dynamic`` among them, for
    ``torch.compile``) and ``fullgraph``."""
    return f"{backend_id} fullgraph={bool(kwargs.get('nopython'))}"


def fingerprint(codes: list) -> bytes:
    """What a set of code entries would install: which codes, bypassed or not, with which guarded code."""
    h = hashlib.sha256()
    for code in codes:
        h.update(repr((code_ident(code), code.bypassed)).encode())
        for digest in sorted(guarded_digest(g) for g in code.guarded_codes):
            h.update(digest)
    return h.digest()


def code_ident(code: Any) -> tuple:
    """Which code object a package's entry (``_DynamoCodeCacheEntry``) is for."""
    return (
        code.python_module,
        code.code_source,
        code.install_to_global,
        tuple(code.function_names) if code.install_to_global else (),
        code_qualname(code.python_code),
        code.python_code.co_firstlineno,
    )


def guarded_digest(guarded_code: Any) -> bytes:
    """A digest of one guarded code of an entry: its guards and its bytecode."""
    return hashlib.sha256(guarded_code.guards_state + pickle.dumps(guarded_code.dynamo_code)).digest()
