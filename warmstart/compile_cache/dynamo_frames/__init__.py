"""Dynamo's output through the store: a frame compiled on one machine is neither traced nor guarded
again on the next. Off unless ``WARMSTART_DYNAMO=1``.

A warm start that finds every compiled graph in the cache still runs Dynamo: it traces each frame's
bytecode again and rebuilds its guards, which on a model of many small layers is most of the start.
torch 2.13 can package what Dynamo produced for a compiled function (``torch._dynamo.package``:
each frame's transformed bytecode, its serialized guards, and the compiled graphs it calls, bundled
by AOTAutograd). warmstart stores that package as one entry (kind ``dynamo_frames``), signed and
verified like every other, and installs it at the compiled function's first call.

torch's own switch for this (``TORCH_CACHING_PRECOMPILE=1``) drops the guards it cannot serialize
(identity checks on modules, functions and closures) from the live process as well, and keys entries
by a function's name and first line. warmstart never drops a guard, and checks what a guard cannot:

* A guard torch cannot serialize is kept only when it checks the identity of a *global* object that
  has the same name in every process: a module, a class, a builtin, or a function reachable from its
  module by its qualified name (plus the function's code). The entry records that name, and a
  process installs the entry only if every such global resolves to the same name (and code) there.
  A frame with any other such guard (the identity of a local object, a dict's version, a weak
  reference) is not packaged: a new machine traces it, as without warmstart.
* What the frames read is recorded while Dynamo traces and checked before installing
  (``frame_reads``): the value behind every guard (which torch would otherwise rebuild from the new
  machine's objects), the calls Dynamo folds into constants without a guard (a rank, a world size:
  their results also pick the stored variant a machine reads), and the hook dictionaries Dynamo found
  empty (checked on every call once installed).
* Entries are keyed, at the first call, by the function (module, qualified name, code), the module's
  structure (``repr``) when a module is compiled, the backend's options, ``dynamic`` and
  ``fullgraph``, and torch's Dynamo, AOTAutograd and Inductor configs. torch, Python and the CPU are
  the store's namespace; torch itself checks at load that the source lines of every function it
  inlined are unchanged. Guards on shapes, dtypes, globals and attributes are evaluated on every
  call, as usual.
* Anything that cannot be loaded is traced, with one log line.

Only ``torch.compile`` with the Inductor backend (the default) is packaged, and not with a
``guard_filter_fn`` (which drops guards on purpose) or CUDA graphs from ``mode="reduce-overhead"``
(torch would load the graphs without them). With it on, AOTAutograd bundles the compiled graphs
into its own entries (torch's ``bundled_autograd_cache``), which packages need: the cache then holds
AOTAutograd entries and no separate FX graph entries.

The code, one idea a module:

* ``state``: what this process knows (the packages it made, what it installed, stored and refused,
  how it compiles), one object that :func:`reset` resets as a whole;
* ``keys``: the key of a function's entry and of its variants, the backend options it is keyed by;
* ``identities``: the globals a package names (behind identity guards, and installed by an entry);
* ``install``: a package per compiled function, and the stored frames installed at its first call;
* ``save``: the frames of a key's packages merged into one entry and stored;
* ``hooks``: the hooks on torch's internals that ``torch_hooks`` installs, which call the above.

What the frames read is recorded and checked by ``frame_reads``, and the names of globals in every
process are ``dynamo_identity``'s.
"""

from __future__ import annotations

from warmstart.compile_cache.dynamo_frames.hooks import (
    frame_compile,
    hook_autograd_cache,
    hook_constant_folds,
    hook_eval_frame,
    hook_guards,
    hook_package,
    hook_precompile_context,
)
from warmstart.compile_cache.dynamo_frames.keys import KIND
from warmstart.compile_cache.dynamo_frames.state import enabled, reset

__all__ = [
    "KIND",
    "enabled",
    "frame_compile",
    "hook_autograd_cache",
    "hook_constant_folds",
    "hook_eval_frame",
    "hook_guards",
    "hook_package",
    "hook_precompile_context",
    "reset",
]
