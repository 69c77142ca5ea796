"""Saving: what this process's packages for a key compiled, merged into one entry (one per variant)
and stored once AOTAutograd has recorded every compiled graph its frames call."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_frames.keys import (
    FORMAT,
    KIND,
    code_ident,
    fingerprint,
    guarded_digest,
    variant_key,
)
from warmstart.compile_cache.dynamo_frames.state import STATE, dynamo_compile_lock
from warmstart.compile_cache.dynamo_identity import code_qualname
from warmstart.compile_cache.storage import fail_open


def save_ready() -> None:
    """Save every key with new frames whose compiled graphs are all recorded."""
    with STATE.lock:
        keys = {s.key for p, s in list(STATE.packages.items()) if s.dirty and s.key is not None}
    for key in keys:
        try:
            with dynamo_compile_lock():  # a backward's graphs are recorded outside any frame compile
                _save(key)
        except Exception as exc:
            for state in list(STATE.packages.values()):
                if state.key == key:
                    state.dirty = False
            fail_open("Dynamo frames write", exc)


def _save(key: str) -> None:
    """Store what this process's packages for ``key`` hold, as one entry.

    Several packages share a key when instances of one module class are compiled one by one
    (regional compilation): each holds the frames it compiled (the first layer's input does not
    require grad, the next ones' does), and the stored entry must hold them all.
    """
    PrecompileContext = torch_internals.require("PrecompileContext")

    from warmstart.compile_cache import get_store

    artifacts = PrecompileContext._backend_artifacts_by_key
    gathered = _gather(key, artifacts)
    for state in gathered.saved:
        state.dirty = False
    codes = gathered.codes()
    if not gathered.saved or not any(not code.bypassed for code in codes):
        return
    store_key = key
    if gathered.folds:  # one entry per result of those calls, found through a record of which calls they are
        calls = sorted(gathered.folds)
        store_key = variant_key(key, frame_reads.variant(calls, [gathered.folds[c] for c in calls]))
    frames = fingerprint(codes)
    if STATE.stored.get(store_key) == frames:
        return  # the store holds these frames already
    data = _entry_bytes(gathered, codes, artifacts)
    STATE.stored[store_key] = frames
    store = get_store()
    if store is not None:
        if gathered.folds:
            variants = pickle.dumps(
                {"format": FORMAT, "variants_by": sorted(gathered.folds)}, protocol=pickle.HIGHEST_PROTOCOL
            )
            store.put(KIND, key, variants, cost_s=gathered.compile_s)
        store.put(KIND, store_key, data, cost_s=gathered.compile_s)


@dataclasses.dataclass
class _Gathered:
    """What this process's packages for one key hold, merged: one entry per code object, and what
    the stored entry carries beside them."""

    merged: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    seen: set[bytes] = dataclasses.field(default_factory=set)
    """Digests of the guarded codes merged so far: each is stored once."""
    identities: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    values: dict[bytes, list] = dataclasses.field(default_factory=dict)
    folds: dict[tuple[str, bytes], str] = dataclasses.field(default_factory=dict)
    inlined: set = dataclasses.field(default_factory=set)
    device_type: str = "cpu"
    compile_s: float = 0.0
    saved: list = dataclasses.field(default_factory=list)
    """The packages' states merged here: no longer dirty once saved."""

    def codes(self) -> list:
        # A code object without guarded code is stored as not packaged: torch would mark it as one
        # Dynamo skips, and a new machine must trace it instead.
        return [
            code if code.guarded_codes or code.bypassed else dataclasses.replace(code, bypassed=True)
            for code in self.merged.values()
        ]


def _gather(key: str, artifacts: dict) -> _Gathered:
    """Merge the packages for ``key`` that are ready: none compiling a frame now, and every
    compiled graph their gathered call recorded."""
    gathered = _Gathered()
    with STATE.lock:
        parts = [(p, s) for p, s in list(STATE.packages.items()) if s.key == key and p.is_initialized()]
    for package, state in parts:
        if package._current_entry is not None:
            continue  # compiling a frame now: saved when that ends
        entry = package.cache_entry()
        if any(backend not in artifacts for code in entry.codes if not code.bypassed for backend in code.backend_ids):
            continue  # the backward is compiled at the first backward: saved then
        for index, code in enumerate(entry.codes):
            if index == 0 or not _unresolved(code):  # the first is the compiled function's own
                _merge(gathered.merged, code, gathered.seen)
        gathered.inlined |= entry.source_info.inlined_sources
        gathered.device_type = entry.device_type
        gathered.identities.update(state.identities)
        gathered.values.update(state.values)
        gathered.folds.update(state.folds.calls)
        gathered.compile_s += state.compile_s
        gathered.saved.append(state)
    return gathered


def _entry_bytes(gathered: _Gathered, codes: list, artifacts: dict) -> bytes:
    """The stored entry: torch's precompile entry for ``codes``, with what loading it needs."""
    PrecompileCacheEntry, SourceInfo, _DynamoCacheEntry = (
        torch_internals.require(name) for name in ("PrecompileCacheEntry", "SourceInfo", "DynamoCacheEntry")
    )

    entry = _DynamoCacheEntry(
        codes=codes,
        source_info=SourceInfo(inlined_sources=gathered.inlined),
        device_type=gathered.device_type,
        fn_name=code_qualname(codes[0].python_code),
        fn_first_lineno=codes[0].python_code.co_firstlineno,
    )
    full = PrecompileCacheEntry.from_cache_entry(entry, artifacts)
    return pickle.dumps(
        {
            "format": FORMAT,
            "entry": full,
            "identities": gathered.identities,
            "values": gathered.values,
            "folds": gathered.folds,
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )


def _unresolved(code: Any) -> bool:
    """Whether a package's entry for a code object is one ``hooks.hook_package`` recorded: no new
    machine could find that code, so it is not stored."""
    return code.bypassed and code.code_source is None and not code.install_to_global and not code.function_names


def _merge(merged: dict[tuple, Any], code: Any, seen: set[bytes]) -> None:
    """Add one package's entry for a code object to ``merged`` (an entry per code object)."""
    ident = code_ident(code)
    guarded = []
    for guarded_code in code.guarded_codes:
        digest = guarded_digest(guarded_code)
        if digest not in seen:
            seen.add(digest)
            guarded.append(guarded_code)
    have = merged.get(ident)
    if have is None:
        merged[ident] = dataclasses.replace(
            code,
            guarded_codes=guarded,
            backend_ids=list(code.backend_ids),
            import_sources=dict(code.import_sources),
            function_names=list(code.function_names),
        )
        return
    if code.bypassed and not have.bypassed:
        return
    if have.bypassed and not code.bypassed:
        merged[ident] = have = dataclasses.replace(have, bypassed=False, guarded_codes=[], backend_ids=[])
    have.guarded_codes.extend(guarded)
    have.backend_ids.extend(b for b in code.backend_ids if b not in have.backend_ids)
    have.import_sources.update(code.import_sources)
    have.function_names.extend(n for n in code.function_names if n not in have.function_names)
    have.has_compile_id = have.has_compile_id or code.has_compile_id
