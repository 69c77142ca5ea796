"""Every :class:`Storage` keeps the same contract: the local tier, the remote tier (a real
redis-server), the read-only view of each, and the tiered store run through the same cases."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from warmstart.compile_cache import LocalTier, ReadOnly, RemoteTier, Storage, TieredStore
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import ABSENT, ERROR, Hit, Miss, MissReason

KIND = "fx_graph"
VALUE = b"compiled graph " * 300


@dataclasses.dataclass
class Subject:
    """A storage under test, what fills it (itself, or the tier a read-only view wraps), and how
    many tiers count a miss (a tiered store asks both)."""

    storage: Storage
    writer: Storage
    tiers_per_miss: int = 1
    owned: list[Storage] = dataclasses.field(default_factory=list)
    """Closed after the test: the tiers a tiered store leaves open."""


def _local(tmp_path) -> LocalTier:
    return LocalTier(tmp_path / "local", 1 << 30)


def _remote(request) -> RemoteTier:
    node = request.getfixturevalue("redis_node")
    return RemoteTier(node.url, secret=b"conformance", namespace="conf")


def _tiered(tmp_path, request) -> Subject:
    local, remote = _local(tmp_path), _remote(request)
    store = TieredStore(local, remote)
    return Subject(store, store, tiers_per_miss=2, owned=[local, remote])


def _read_only(tier: Storage) -> Subject:
    return Subject(ReadOnly(tier), tier)


SUBJECTS: dict[str, Callable[..., Subject]] = {
    "local": lambda tmp_path, request: Subject(*[_local(tmp_path)] * 2),
    "remote": lambda tmp_path, request: Subject(*[_remote(request)] * 2),
    "read-only local": lambda tmp_path, request: _read_only(_local(tmp_path)),
    "read-only remote": lambda tmp_path, request: _read_only(_remote(request)),
    "tiered": _tiered,
}


@pytest.fixture(params=list(SUBJECTS))
def subject(request, tmp_path) -> Iterator[Subject]:
    made = SUBJECTS[request.param](tmp_path, request)
    yield made
    for storage in (made.storage, made.writer, *made.owned):
        storage.close()


def _counts(stats: Stats) -> tuple[int, int]:
    """Hits and misses of ``KIND`` over every tier."""
    items = [counts for (_, kind), counts in stats.items() if kind == KIND]
    return sum(c.hits for c in items), sum(c.misses for c in items)


def test_it_is_a_storage(subject):
    assert isinstance(subject.storage, Storage)
    assert subject.storage.name and isinstance(subject.storage.stats, Stats)


def test_put_then_get_hits_with_the_same_bytes(subject):
    assert subject.writer.put(KIND, "k", VALUE, cost_s=1.5) is True
    result = subject.storage.get(KIND, "k")
    assert isinstance(result, Hit) and result
    assert result.value == VALUE and result.cost_s == pytest.approx(1.5)


def test_a_missing_key_is_a_miss_that_says_absent(subject):
    result = subject.storage.get(KIND, "never-stored")
    assert isinstance(result, Miss) and not result
    assert result.reason is ABSENT and result.value is None


def test_put_of_an_existing_key_reports_stored(subject):
    assert subject.writer.put(KIND, "k", VALUE) is True
    assert subject.writer.put(KIND, "k", VALUE) is True
    assert subject.storage.get(KIND, "k").value == VALUE


def test_stats_count_hits_and_misses(subject):
    stats = subject.storage.stats
    subject.writer.put(KIND, "k", VALUE)
    assert _counts(stats) == (0, 0)
    subject.storage.get(KIND, "k")
    subject.storage.get(KIND, "k")
    subject.storage.get(KIND, "absent")
    assert _counts(stats) == (2, subject.tiers_per_miss)


def test_stats_can_be_replaced_and_the_tier_counts_there(subject):
    shared = Stats()
    subject.storage.stats = shared
    assert subject.storage.stats is shared
    subject.storage.get(KIND, "absent")
    assert _counts(shared) == (0, subject.tiers_per_miss)


def test_writable_says_whether_put_stores(subject):
    assert isinstance(subject.storage.writable, bool)
    stored = subject.storage.put(KIND, "w", VALUE)
    assert stored is subject.storage.writable
    assert bool(subject.storage.get(KIND, "w")) is subject.storage.writable


def test_close_is_idempotent_and_later_calls_miss_without_raising(subject):
    subject.writer.put(KIND, "k", VALUE)
    subject.storage.close()
    subject.storage.close()
    result = subject.storage.get(KIND, "k")
    assert isinstance(result, Miss) and result.reason is ERROR, result
    assert subject.storage.put(KIND, "k2", VALUE) is False


def test_a_read_only_view_refuses_put_and_counts_dropped(subject):
    view = subject.storage if isinstance(subject.storage, ReadOnly) else ReadOnly(subject.storage)
    assert view.put(KIND, "k", VALUE) is False
    assert view.get(KIND, "k").reason is ABSENT  # nothing reached the tier
    assert view.stats.get(view.name, KIND).dropped == 1
    assert view.writable is False


def test_miss_reasons_are_strings_in_json_and_messages():
    import json

    assert json.dumps({"reason": MissReason.BREAKER_OPEN}) == '{"reason": "breaker_open"}'
    assert f"{MissReason.TIMEOUT}" == str(MissReason.TIMEOUT) == "timeout" == MissReason("timeout")
