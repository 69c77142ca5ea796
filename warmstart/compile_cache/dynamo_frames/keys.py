"""What names stored frames: the key of a compiled function's entry and of its variants, the id of the
backend options it compiles with, and digests of the code entries an entry would install."""

from __future__ import annotations

import hashlib
import os
import pickle
import types
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache.dynamo_frames.state import enabled
from warmstart.compile_cache.dynamo_identity import code_digest, code_qualname, stable_repr

KIND = "dynamo_frames"
#: The layout of a stored entry; part of every key.
FORMAT = 3


def entry_key(function: types.FunctionType, module: Any, backend_id: str, dynamic: Any, fullgraph: bool) -> str:
    """The key of ``function``'s frames: the function (module, qualified name, code), the module's
    structure (``repr``) when a module is compiled, the backend's options, ``dynamic``,
    ``fullgraph`` and torch's Dynamo, AOTAutograd and Inductor configs."""
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
        # Paths (where torch is installed, where debug output goes: the working directory) are this
        # machine's and change nothing Dynamo or Inductor produce.
        settings = sorted(
            (k, v) for k, v in config.save_config_portable().items() if not (isinstance(v, str) and os.path.isabs(v))
        )
        h.update(stable_repr(settings).encode() + b"\0")
    return h.hexdigest()


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
