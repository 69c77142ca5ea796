"""Why a job missed: its logged misses with their reasons, and what differs from the server's entries.

The job's processes log each miss with the reason the store gave (``miss_log.py``). A miss the job
saw as ``absent`` may still have an entry on the server under another namespace or signing key:
:func:`explain` asks the server (one pipelined ``EXISTS`` per miss and registered namespace) and
names it ``other_namespace`` or ``other_key_id``. The server's namespace registry (one small hash,
written once by each writing process) holds each namespace's components, so the components in
which this machine differs from the entries the server holds are named without scanning keys;
everything here works with reader credentials.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.compile_cache import signing
from warmstart.compile_cache.miss_log import last_run_dir, read_misses, recent_run_dirs
from warmstart.compile_cache.storage import (
    ABSENT,
    BREAKER_OPEN,
    ERROR,
    EVICTED,
    MISS_REASONS,
    OTHER_KEY_ID,
    OTHER_NAMESPACE,
    REJECTED,
    SKIPPED,
    SKIPPED_REASONS,
    TIMEOUT,
)
from warmstart.config import Settings, redact_url

if TYPE_CHECKING:
    from warmstart.compile_cache.remote import RemoteTier

#: How each namespace component is called in the advice, and what to do when it differs.
COMPONENT_ADVICE: dict[str, str] = {
    "user": "WARMSTART_NAMESPACE differs: use the same namespace as the jobs that filled the cache",
    "torch": "torch versions differ: compiled artifacts are only shared between identical torch versions",
    "triton": "Triton versions differ: install the same Triton (it comes with torch) as the jobs that filled the cache",
    "python_abi": "Python versions differ (their ABI): use the same Python as the jobs that filled the cache",
    "cpu_isa": "the CPUs differ in vector instructions: code compiled for one may not run on the other, so "
    "these machines cannot share entries (give each machine type its own cache server or namespace)",
    "gpu_arch": "GPU architectures (or CUDA versions) differ: kernels are not portable between them",
    "format": "warmstart versions differ in their cache format: upgrade every job to the same warmstart",
}

_REASON_ADVICE = {
    ABSENT: "never compiled against this cache: expected on a first start or after a code change; "
    "what torch found in its own cache on this machine (TORCHINDUCTOR_CACHE_DIR) it neither looked up "
    "nor stored here, so a job after a plain torch run of the same model fills the shared cache only "
    "with an empty TORCHINDUCTOR_CACHE_DIR",
    EVICTED: "the server evicted these blobs for memory: raise its --maxmemory (`warmstart server status` "
    "shows evictions)",
    OTHER_KEY_ID: "entries exist signed with another key: give this job the writers' verify.pub (or their "
    "secret) in WARMSTART_KEY_FILE / WARMSTART_SECRET",
    REJECTED: "entries failed verification (damaged, or written by someone without the key): they were "
    "never loaded; `warmstart cache doctor` checks the setup",
    BREAKER_OPEN: "a tier was not asked: it was off after a failure (the remote tier's circuit breaker had "
    "opened after a failed or slow operation, or the local database was damaged or stayed locked): "
    "`warmstart cache doctor` checks the connection",
    TIMEOUT: "lookups ran out of time (a slow or stalled server past the operation deadline, a local "
    "database locked past its wait, or the process's WARMSTART_MAX_WAIT_S spent): check the server's "
    "load and latency (`warmstart cache doctor` measures it)",
    ERROR: "lookups failed (a refused connection, credentials that may not read, an I/O error; each "
    "miss's detail says which): `warmstart cache doctor` checks the setup",
    SKIPPED: "the remote tier was not asked (its breaker was open after a failure, or lookups failed): "
    "`warmstart cache doctor` checks the connection",
}
_NEVER_STORED = "never_stored"
"""Advice for ``absent`` misses that earlier jobs of this cache missed too (the reason stays ``absent``)."""
_REASON_ADVICE[_NEVER_STORED] = (
    "missed by earlier jobs of this cache too, so never stored: torch writes some entries only later "
    "(an AOTAutograd entry at the graph's first backward, which a forward-only script never runs), "
    "or every job ran with WARMSTART_CACHE_MODE=ro; the first needs no change"
)
_ADVICE_ORDER = (OTHER_KEY_ID, EVICTED, REJECTED, BREAKER_OPEN, TIMEOUT, ERROR, SKIPPED, _NEVER_STORED, ABSENT)
"""Most telling first; ``skipped`` here is only what a log from before the three were told apart holds."""
_MAX_CHECKED = 5000  # misses asked about on the server; a bigger log is sampled from its start


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found; :meth:`to_dict` is ``warmstart cache explain --json``."""

    run_dir: Path | None
    misses: list[dict[str, object]]
    """Each miss: ``kind``, ``key``, ``reason`` (after asking the server), ``tier``, and ``detail`` when known."""
    namespace: str
    components: dict[str, str]
    """This machine's namespace components."""
    key_id: str
    others: list[dict[str, object]]
    """Other namespaces and key ids registered on the server: ``namespace``, ``key_id``, ``differs``
    (component -> [this machine, theirs])."""
    namespace_diff: list[str]
    """Components in which this machine differs from the closest namespace the server holds entries for."""
    server: str | None
    """The server asked (password redacted), or why none was."""

    @property
    def reasons(self) -> dict[str, int]:
        """Misses per reason; ``skipped`` is the sum of ``breaker_open``, ``timeout`` and ``error``
        (and of the ``skipped`` misses of older logs)."""
        return _with_skipped(collections.Counter(str(m["reason"]) for m in self.misses))

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Misses per artifact kind and reason (with ``skipped`` summed as in :attr:`reasons`)."""
        table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for miss in self.misses:
            table[str(miss["kind"])][str(miss["reason"])] += 1
        return {kind: _with_skipped(counts) for kind, counts in sorted(table.items())}

    def columns(self) -> list[str]:
        """The reasons a table of these misses shows: each one given, and ``skipped`` only for the
        misses of an older log that gave no more than that."""
        counts = collections.Counter(str(m["reason"]) for m in self.misses)
        return [reason for reason in (*MISS_REASONS, SKIPPED) if counts[reason]]

    def advice(self) -> list[str]:
        """What to change, one line each, most telling first."""
        lines = []
        counts = collections.Counter(str(m["reason"]) for m in self.misses)
        counts[_NEVER_STORED] = sum(1 for m in self.misses if m["reason"] == ABSENT and m.get("earlier"))
        counts[ABSENT] -= counts[_NEVER_STORED]
        if counts[OTHER_NAMESPACE] or (
            self.namespace_diff and not any(o["namespace"] == self.namespace for o in self.others)
        ):
            lines += [f"{name}: {COMPONENT_ADVICE.get(name, 'differs')}" for name in self.namespace_diff]
        for reason in _ADVICE_ORDER:
            if counts[reason]:
                name = f"{ABSENT}, every time" if reason == _NEVER_STORED else reason
                lines.append(f"{name} ({counts[reason]}): {_REASON_ADVICE[reason]}")
        return lines

    def to_dict(self) -> dict[str, object]:
        return {
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "reasons": self.reasons,
            "misses": [{k: m[k] for k in ("kind", "key", "reason", "tier", "detail") if k in m} for m in self.misses],
            "by_kind": self.by_kind(),
            "namespace_diff": self.namespace_diff,
            "namespace": {"id": self.namespace, "key_id": self.key_id, "components": self.components},
            "others": self.others,
            "advice": self.advice(),
            "server": self.server,
        }


def _with_skipped(counts: collections.Counter[str]) -> dict[str, int]:
    """``counts`` of the known reasons, in their order, with ``skipped`` as the sum of the reasons
    it was split into (JSON readers from before the split keep reading it)."""
    out = {reason.value: counts[reason] for reason in MISS_REASONS if counts[reason]}
    skipped = counts[SKIPPED] + sum(counts[reason] for reason in SKIPPED_REASONS)
    if skipped:
        out[SKIPPED] = skipped
    return out


def explain(settings: Settings, run_dir: Path | None = None) -> Explanation:
    """Explain the misses logged under ``run_dir`` (default: the last job that used
    ``settings.cache_dir``), asking the server in ``settings.cache_url`` where entries are.

    Raises:
        FileNotFoundError: no run directory was given and no job has logged a miss here yet.
    """
    from warmstart.compile_cache.namespace import components, namespace

    if run_dir is None:
        run_dir = last_run_dir(settings.cache_dir)
        if run_dir is None:
            raise FileNotFoundError(
                f"no job has logged a cache miss in {settings.cache_dir} yet; "
                "give the job's run directory (WARMSTART_RUN_DIR)"
            )
    misses = read_misses(run_dir)
    ours = namespace(settings.namespace)
    mine = dict(components(settings.namespace))
    key_id = next((str(m["key_id"]) for m in reversed(misses) if m.get("key_id")), "")
    result = Explanation(run_dir, misses, ours, mine, key_id, [], [], None)
    url = settings.cache_url
    if not url:
        result.server = "no remote tier (WARMSTART_CACHE_URL is unset)"
    else:
        try:
            _ask_server(settings, url, result)
        except Exception as exc:  # an unreachable server leaves the job's own reasons
            result.server = f"{redact_url(url)} could not be asked ({type(exc).__name__}: {exc})"
    _mark_missed_before(settings, result)
    return result


def _mark_missed_before(settings: Settings, result: Explanation) -> None:
    """Each ``absent`` miss that earlier jobs of this cache directory missed as well gets ``earlier``
    (how many of them) and a detail saying so: an entry every job misses is one nothing stores."""
    absent = [m for m in result.misses if m["reason"] == ABSENT]
    if not absent or result.run_dir is None:
        return
    start = min(_number(m.get("ts", 0)) for m in result.misses)
    this_run = Path(result.run_dir).resolve()
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    for run_dir in recent_run_dirs(settings.cache_dir):
        if not run_dir.is_dir() or run_dir.resolve() == this_run:
            continue
        earlier = {
            (str(m["kind"]), str(m["key"]))
            for m in read_misses(run_dir)
            if m["reason"] == ABSENT and _number(m.get("ts", 0)) < start
        }
        seen.update(earlier)
    for miss in absent:
        runs = seen[(str(miss["kind"]), str(miss["key"]))]
        if runs:
            miss["earlier"] = runs
            miss["detail"] = f"missed in {runs} earlier job{'s' if runs > 1 else ''} of this cache too: never stored"


def _ask_server(settings: Settings, url: str, result: Explanation) -> None:
    # Imported here: redis loads only for the explanations that ask a server.
    from warmstart.compile_cache.remote import RemoteTier

    # Only the registry and EXISTS are read: no entry is verified, so any key will do to connect.
    keys = signing.keys_for(settings.key_file, settings.secret) or signing.HmacKeys(b"-")
    tier = RemoteTier(url, keys=keys, namespace=result.namespace)
    try:
        result.key_id = result.key_id or keys.key_id
        result.server = redact_url(url)
        result.others.extend(_other_namespaces(result, tier.registry()))
        found_in = _find_holders(result, tier)
        result.namespace_diff = _closest_diff(result, found_in)
    finally:
        tier.close()


def _other_namespaces(result: Explanation, registry: list[dict[str, object]]) -> list[dict[str, object]]:
    """The registered namespaces and key ids other than this job's, each with the components in
    which it differs from this machine's (``{name: [ours, theirs]}``)."""
    others: list[dict[str, object]] = []
    for entry in registry:
        if (entry["namespace"], entry["key_id"]) == (result.namespace, result.key_id):
            continue
        theirs = entry["components"]
        if not isinstance(theirs, dict):  # registry() keeps only entries whose components are
            continue
        differs = {
            name: [result.components.get(name, ""), str(theirs.get(name, ""))]
            for name in sorted(set(result.components) | set(theirs))
            if result.components.get(name, "") != str(theirs.get(name, ""))
        }
        others.append({"namespace": entry["namespace"], "key_id": entry["key_id"], "differs": differs})
    return others


def _find_holders(result: Explanation, tier: RemoteTier) -> collections.Counter:
    """Name the ``absent`` misses (of the first ``_MAX_CHECKED``) that another namespace or key id
    holds an entry for; how many of them each other namespace holds."""
    pairs = [(str(o["namespace"]), str(o["key_id"])) for o in result.others]
    found_in: collections.Counter = collections.Counter()
    absent = [m for m in result.misses[:_MAX_CHECKED] if m["reason"] == ABSENT]
    entries = [(str(m["kind"]), str(m["key"])) for m in absent]
    answers = tier.holders(entries, pairs) if pairs else [[] for _ in entries]
    for miss, holders in zip(absent, answers, strict=True):
        if not holders:
            continue
        same_ns = [p for p in holders if p[0] == result.namespace]
        miss["reason"] = OTHER_KEY_ID if same_ns else OTHER_NAMESPACE
        miss["detail"] = "held by " + ", ".join(f"namespace {ns} key {kid}" for ns, kid in holders[:3])
        found_in.update(ns for ns, _ in holders if ns != result.namespace)
    return found_in


def _closest_diff(result: Explanation, found_in: collections.Counter) -> list[str]:
    """The components that differ from the namespace holding most of the missed entries, else from
    the registered namespace closest to this machine's (fewest differences)."""
    other_ns = [o for o in result.others if o["namespace"] != result.namespace]
    if not other_ns:
        return []
    if found_in:
        best = found_in.most_common(1)[0][0]
        chosen = next(o for o in other_ns if o["namespace"] == best)
    else:
        chosen = min(other_ns, key=lambda o: (len(_differs(o)), -_number(o.get("ts", 0))))
    return sorted(_differs(chosen))


def _differs(other: dict[str, object]) -> dict[str, object]:
    """The components in which ``other`` (an entry of :attr:`Explanation.others`) differs."""
    differs = other["differs"]
    return differs if isinstance(differs, dict) else {}


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
