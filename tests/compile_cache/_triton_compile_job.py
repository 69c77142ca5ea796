"""One job for the Triton compile test: compile a kernel with Triton's own ``compile()`` for a Hopper
target (sm_90), as a GPU job's first launch would, and print one ``RESULT`` JSON line.

Triton 3.6 lowers a kernel to PTX and assembles it with the ``ptxas`` its wheel ships without
touching a GPU, so this runs on any x86-64 machine. The line holds whether Triton found the kernel in
its cache (its compilation listener's ``cache_hit``), the SHA-256 of the cubin, the cache manager
Triton was given, and warmstart's shared-tier counts for Triton's files.
"""

from __future__ import annotations

import hashlib
import json
import os

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def main() -> None:
    hits: list[bool] = []
    knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    kernel = triton.compile(
        ASTSource(fn=add_kernel, signature=signature, constexprs={"BLOCK": 1024}), target=GPUTarget("cuda", 90, 32)
    )
    from warmstart.compile_cache import get_store

    store = get_store()
    remote = {}
    if store is not None:
        store.flush(timeout=30)
        remote = store.stats.to_dict().get("remote", {}).get("triton_kernel", {})
    result = {
        "cache_hit": hits,
        "cubin": hashlib.sha256(kernel.asm["cubin"]).hexdigest(),
        "ptx_has_kernel": "add_kernel" in kernel.asm["ptx"],
        "manager": os.environ.get("TRITON_CACHE_MANAGER"),
        "remote": {k: remote.get(k, 0) for k in ("hits", "misses", "writes", "rejected")},
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
